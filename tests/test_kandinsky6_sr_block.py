"""Kandinsky 6 SR's transformer block streamed whole from its captured graph (``integrations/diffusers/flex_nabla.py``):
its NABLA mask, a threshold over every row's Q and K block means, is a contraction over every row
(``graph.row_contractions``) built once in phase KV by the library's own ``nabla_block_mask``; each Q chunk attends
every key under it through the flex consumer. Exact against the real block's own forward (fp32, CPU), the same mask as
stock's, below stock's measured peak; what streamplan does not follow keeps the block stock, named."""
import pytest
import torch

from conftest import streamed  # noqa: E402

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from streamplan.specs import GraphSpec  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

CPU = torch.device("cpu")
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _block(rows: int):
    case = CASES["kandinsky6_sr"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


class _StockMasks:
    """The BlockMask of every flex call diffusers' flex backend makes (the stock block's)."""

    def __init__(self, monkeypatch):
        import torch.nn.attention.flex_attention as fa
        self.masks, real = [], fa.flex_attention

        def recorded(*a, **kw):
            self.masks.append(kw.get("block_mask"))
            return real(*a, **kw)
        monkeypatch.setattr(fa, "flex_attention", recorded)


class _StreamedMasks:
    """The masks the flex consumer unpacks from a graph's block tables, and the query rows of every chunk it attends."""

    def __init__(self, monkeypatch):
        import streamplan.attention.flex as flex
        self.masks, self.rows = [], []
        unpack, chunk = flex.tables_block_mask, flex.flex_chunk

        def unpacked(*a, **kw):
            self.masks.append(unpack(*a, **kw))
            return self.masks[-1]

        def counted(q, *a, **kw):
            self.rows.append(q.shape[-2])
            return chunk(q, *a, **kw)
        monkeypatch.setattr(flex, "tables_block_mask", unpacked)
        monkeypatch.setattr(flex, "flex_chunk", counted)


@torch.no_grad()
@pytest.mark.parametrize("rows", [512, 1536])
def test_the_block_streams_whole_under_the_stock_mask_exactly(rows, monkeypatch):
    block, args, kwargs = _block(rows)
    stock = _StockMasks(monkeypatch)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        assert isinstance(handle.installed[""].spec, GraphSpec), handle.report()
        got = _StreamedMasks(monkeypatch)
        out = block(*args, **kwargs)
        report = handle.report()
        plans = handle.plans
    root = plans[""]
    assert root and root[0].tier == "L1" and root[0].chunk == 128 and root[0].rows == rows, report
    assert not plans.get("self_attention") and not plans.get("feed_forward"), report   # whole, not its parts
    assert "captured diffusers.Kandinsky6SRTransformerBlock" in report and "1 global attention(s)" in report, report
    assert got.rows == [128] * (rows // 128), got.rows
    assert len(got.masks) == 1, len(got.masks)   # one mask per call, unpacked once for every chunk
    stock_mask, streamed_mask = stock.masks[0], got.masks[0]
    density = stock_mask.to_dense().float().mean()
    assert 0 < density < 1, density   # a sparse choice: the threshold picked some blocks and left others
    for name in TABLES:
        assert torch.equal(getattr(streamed_mask, name), getattr(stock_mask, name)), name
    assert torch.equal(out, ref)   # the same fp32 softmax per query row as the stock call's


@torch.no_grad()
def test_the_whole_block_peaks_below_stock_and_below_its_parts():
    block, args, kwargs = _block(2048)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    peaks, whole = {}, {}
    for capture in ("fallback", "off"):   # the block whole, then its parts alone (the attention and the MLP)
        with streamed(block, chunk_tokens=128, capture=capture) as handle:
            out, peaks[capture] = streamplan.measure_peak(block, *args, **kwargs)
            whole[capture] = [p for p in handle.plans.get("", []) if p.tier == "L1"]
        assert torch.equal(out, ref), capture
    assert whole["fallback"] and not whole["off"], whole
    assert peaks["fallback"] < 0.1 * stock, (peaks, stock)   # uncompiled flex's scores: one chunk's, not every row's
    assert peaks["fallback"] < peaks["off"], (peaks, stock)   # no whole-sequence norm, modulation or residual sums
    # the planner's prediction (uncompiled flex's scores over every key included) against the meter's
    assert 0.9 < whole["fallback"][0].predicted_peak / peaks["fallback"] < 1.15, (whole["fallback"][0], peaks)


@torch.no_grad()
def test_an_unfollowed_processor_keeps_the_block_stock_named():
    import diffusers.models.transformers.transformer_kandinsky6_sr as k6

    class Custom(k6.Kandinsky6SRAttnProcessor):
        pass
    block, args, kwargs = _block(512)
    block.self_attention.set_processor(Custom())
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=128, capture="prefer") as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        root = handle.plans.get("", [])
    assert not [p for p in root if p.tier != "L0"], report
    assert "capture failed" in report, report   # its mask builder traced as it is: the 64-row blocks fix the count
    assert torch.equal(out, ref)


# -- chunks on the flex consumer's query blocks; the mask's tables and their build priced -----------------------------

@torch.no_grad()
def test_a_forced_chunk_off_the_query_blocks_is_rounded_to_them_and_said(monkeypatch):
    """Every chunk starts on a 128-row query block, so it takes its blocks' rows of the mask as they are (a chunk
    starting inside one visits every key block: exact, but none of the sparsity a compiled flex would use)."""
    block, args, kwargs = _block(1536)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=200) as handle:
        got = _StreamedMasks(monkeypatch)
        out = block(*args, **kwargs)
        report = handle.report()
        (plan,) = handle.plans[""]
    assert plan.tier == "L1" and plan.chunk == 128, report
    assert "chunk_tokens=200 rounded to 128" in report, report
    assert got.rows == [128] * 12, got.rows
    assert torch.equal(out, ref)


def test_the_planner_rounds_a_chosen_chunk_down_to_the_alignment_never_below_one_unit():
    from streamplan.plan.planner import BudgetError, plan_graph
    rows, fixed, per_row = 8192, 1 << 20, 1000

    def plan(budget: int, align: int):
        return plan_graph(rows, fixed, lambda c, sl: c * per_row, 1 << 40, budget=budget, align=align)

    budget = fixed + 1300 * per_row   # fits 1,280 rows (whole 256-row steps of the search)
    assert plan(budget, 1).chunk == 1280
    assert plan(budget, 384).chunk == 1152   # three 384-row units
    assert plan(budget, 128).chunk == 1280   # already whole units
    small = plan(fixed + 600 * per_row, 512)   # the search's 512 rows
    assert small.chunk == 512 and small.predicted_peak == fixed + 512 * per_row
    with pytest.raises(BudgetError):   # one unit is the least: a budget short of it is refused, not undercut
        plan(fixed + 700 * per_row, 1024)


def _meter(fn):
    return streamplan.measure_peak(fn, device=CPU)


@torch.no_grad()
def test_the_mask_builds_and_unpacking_allocate_what_they_declare():
    """The declarations the memory model prices the mask by, against the meter on the library's own builder and the
    flex consumer's unpacking, at 8,192 rows (128 blocks of 64)."""
    from streamplan.attention import FLEX
    from streamplan.integrations.diffusers.flex_nabla import _tables_workspace
    block, args, kwargs = _block(8192)
    sta = args[3]["sta_mask"]
    q, k = torch.randn(1, 8192, 4, 16), torch.randn(1, 8192, 4, 16)
    tables, built = _meter(lambda: torch.ops.streamplan.nabla_block_tables(q, k, sta, 0.8, 64))
    packed = tables.numel() * 4
    declared = packed + _tables_workspace(tables, q, k, sta, 0.8, 64)
    assert 0.95 < declared / built < 1.1, (declared, built)
    held, making = FLEX.graph_mask_bytes(tables)
    mask, unpacking = _meter(lambda: FLEX._unpacked(tables, 8192))
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
        mask.block_mask.kv_indices, mask.block_mask.full_kv_num_blocks, mask.block_mask.q_indices,
        mask.block_mask.full_q_indices)}
    assert 0.95 < held / sum(kept.values()) < 1.05, (held, kept)
    assert 1.0 <= making / unpacking < 1.15, (making, unpacking)


@torch.no_grad()
def test_the_planners_peak_holds_by_the_meter_at_8192_rows_and_near_the_smallest_budget():
    """The mask's tables and the consumer's unpacked BlockMask held through phase Q, every row's Q and K let go once
    the tables are built: the prediction within a few percent of the meter, and a budget 1% above the smallest the
    planner reaches holds."""
    block, args, kwargs = _block(8192)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out, peak = _meter(lambda: block(*args, **kwargs))
        (plan,) = handle.plans[""]
    assert plan.tier == "L1" and torch.equal(out, ref)
    assert 0.98 < plan.predicted_peak / peak < 1.03, (plan, peak)
    with streamed(block, budget=8 << 20) as handle:   # the inputs fit, the work does not: the smallest is said
        with pytest.raises(streamplan.BudgetError) as refused:
            block(*args, **kwargs)
    budget = int(refused.value.smallest_bytes * 1.01)
    with streamed(block, budget=budget) as handle:
        out, peak = _meter(lambda: block(*args, **kwargs))
        (plan,) = handle.plans[""]
    assert plan.tier == "L1" and plan.chunk % 128 == 0 and torch.equal(out, ref), plan
    assert plan.live_bytes + peak <= budget, (plan, peak, budget)
    assert 0.98 < plan.predicted_peak / peak < 1.05, (plan, peak)
