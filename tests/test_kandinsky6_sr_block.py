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
