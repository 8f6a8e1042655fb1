"""Flex attention (``streamplan/attention/flex.py``): a Q chunk against the whole K/V under the call's BlockMask cut to
the chunk's query blocks, exact against torch's own flex call over every query row; Wan Animate 2's self-attention on
its generation step (``integrations/diffusers/flex.py``) streamed through it, exact against the real block's forward
(fp32, CPU) and below its measured peak; what a chunk cannot stand for stays stock, named."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from conftest import rel_err, streamed  # noqa: E402

import streamplan
from streamplan.attention.flex import FlexMask, block_mask_problem, chunk_block_mask, flex_chunk

CPU = torch.device("cpu")


def _qkv(rows: int, keys: int, heads: int = 2, d: int = 16):
    return (torch.randn(1, heads, rows, d), torch.randn(1, heads, keys, d), torch.randn(1, heads, keys, d))


def _masks(rows: int, keys: int):
    """A mask_mod over global query indices that reads a captured per-query tensor (a window), and a score_mod that
    reads another: what a chunk sees only if its query index is shifted to the global one."""
    reach = torch.randint(0, keys, (rows,))
    bias = torch.randn(rows)

    def mask_mod(b, h, q, kv):
        return (kv <= reach[q]) | (kv == q % keys)

    def score_mod(s, b, h, q, kv):
        return s + bias[q]

    return create_block_mask(mask_mod, None, None, rows, keys, device="cpu"), score_mod


@torch.no_grad()
@pytest.mark.parametrize("bounds", [[(0, 128), (128, 256), (256, 300)],              # aligned chunks
                                    [(0, 64), (64, 192), (192, 300)]])                # chunks inside a query block
def test_chunks_under_the_cut_mask_give_the_whole_calls_rows_exactly(bounds):
    rows, keys = 300, 420
    q, k, v = _qkv(rows, keys)
    block_mask, score_mod = _masks(rows, keys)
    whole = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    mask = FlexMask(block_mask, score_mod)
    parts = [flex_chunk(q[:, :, a:b], k, v, q_offset=a, mask=mask, scale=None) for a, b in bounds]
    assert torch.equal(torch.cat(parts, 2), whole)


def test_an_aligned_chunks_tables_are_its_query_blocks_rows():
    block_mask, _ = _masks(512, 384)
    cut = chunk_block_mask(block_mask, 256, 200)
    assert cut.seq_lengths == (200, 384) and cut.BLOCK_SIZE == block_mask.BLOCK_SIZE
    assert torch.equal(cut.kv_num_blocks, block_mask.kv_num_blocks[..., 2:4])
    assert torch.equal(cut.kv_indices, block_mask.kv_indices[..., 2:4, :])
    assert torch.equal(cut.full_kv_num_blocks, block_mask.full_kv_num_blocks[..., 2:4])


def test_what_a_chunk_cannot_stand_for_is_named():
    block_mask, _ = _masks(512, 384)
    assert block_mask_problem(block_mask, q_len=512, kv_len=384) is None
    assert "sliced" in block_mask_problem(block_mask[:, :, :2], q_len=512, kv_len=384)
    assert "is for 512 x 384" in block_mask_problem(block_mask, q_len=512, kv_len=512)
    big = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 512, 512, device="cpu", BLOCK_SIZE=256)
    assert "query blocks of 256 rows do not divide the chunk alignment (128)" in block_mask_problem(
        big, q_len=512, kv_len=512)


# -- Wan Animate 2 --------------------------------------------------------------------------------------------------
pytest.importorskip("diffusers")
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402


def _wan_animate2(rows: int):
    case = CASES["wan_animate2"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


class _Counting:
    """Counts the flex consumer's chunks (the rows each attends), answering with its own call."""

    def __init__(self, monkeypatch):
        import streamplan.attention.flex as flex
        self.rows, real = [], flex.flex_chunk

        def counted(q, *a, **kw):
            self.rows.append(q.shape[-2])
            return real(q, *a, **kw)
        monkeypatch.setattr(flex, "flex_chunk", counted)


@torch.no_grad()
@pytest.mark.parametrize("rows", [400, 800])
def test_wan_animate2_generation_step_streams_its_flex_attention_exactly(rows, monkeypatch):
    block, args, kwargs = _wan_animate2(rows)
    ref = block(*args, **kwargs)
    counted = _Counting(monkeypatch)
    with streamed(block.self_attn, chunk_tokens=128) as handle:   # the part alone (the block streams whole: see
        out = block(*args, **kwargs)                             # tests/test_wan_animate2_block.py)
        report = handle.report()
        plans = handle.plans[""]
    assert plans[0].tier == "L1" and plans[0].chunk == 128, report
    assert "WanAnimate2Attention[flex BlockMask" in report, report
    assert counted.rows == [128] * (rows // 128) + [rows % 128], counted.rows
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out, ref)   # the same fp32 softmax per query row as the stock call's


@torch.no_grad()
def test_wan_animate2_streamed_peak_is_below_stock():
    block, args, kwargs = _wan_animate2(1600)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block.self_attn, chunk_tokens=128):
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
    assert torch.equal(out, ref)
    assert peak < 0.35 * stock, (peak, stock)   # uncompiled flex's scores over every key: one chunk's, not all rows'


@torch.no_grad()
def test_wan_animate2_mask_with_query_blocks_wider_than_the_chunk_alignment_stays_stock_named(monkeypatch):
    block, args, kwargs = _wan_animate2(400)
    given = kwargs["attention_mask"]
    kwargs["attention_mask"] = create_block_mask(given.mask_mod, None, None, *given.seq_lengths, device="cpu",
                                                 BLOCK_SIZE=256)
    ref = block(*args, **kwargs)
    counted = _Counting(monkeypatch)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "query blocks of 256 rows do not divide the chunk alignment (128)" in report, report
    assert counted.rows == [] and torch.equal(out, ref)


@torch.no_grad()
def test_wan_animate2_rows_past_its_grid_stay_stock_named(monkeypatch):
    block, args, kwargs = _wan_animate2(400)
    args = (torch.cat([args[0], torch.randn(1, 8, 64)], 1), *args[1:])   # 8 padding rows after the grid's 400
    ref = block(*args, **kwargs)
    counted = _Counting(monkeypatch)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "its grid covers 400 of its 408 rows" in report, report
    assert counted.rows == [] and torch.equal(out, ref)


def test_chunks_of_a_mask_built_from_block_lists_alone_give_the_whole_calls_rows_exactly():
    """A mask made with ``from_kv_blocks`` and no mask_mod (NABLA's: torch gives it ``noop_mask``) is taken as it is,
    not refused as sliced, and its chunks, aligned or starting inside a query block (a retried half), give the rows
    of the whole call as torch runs it uncompiled (its elements decided by the mask_mod alone)."""
    from torch.nn.attention.flex_attention import BlockMask
    torch.manual_seed(1)
    rows = 512
    dense = torch.rand(1, 2, rows // 64, rows // 64) < 0.4
    dense |= torch.eye(rows // 64, dtype=torch.bool)
    num, idx = dense.sum(-1).to(torch.int32), dense.int().argsort(-1, descending=True).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=64, mask_mod=None)
    q, k, v = _qkv(rows, rows)
    whole = flex_attention(q, k, v, block_mask=block_mask)
    mask = FlexMask(block_mask)
    bounds = [(0, 96), (96, 160), (160, 352), (352, 512)]   # starts at 96 and 160: inside 64-row blocks
    parts = [flex_chunk(q[:, :, a:b], k, v, q_offset=a, mask=mask, scale=None) for a, b in bounds]
    assert torch.equal(torch.cat(parts, 2), whole)
    assert block_mask_problem(block_mask, q_len=rows, kv_len=rows) is None


# -- Kandinsky 6 SR (NABLA) -----------------------------------------------------------------------------------------
def _kandinsky6_sr(rows: int):
    case = CASES["kandinsky6_sr"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


class _NablaMasks:
    """Records every mask ``nabla_block_mask`` builds (stock's and the streamed call's), answering with its own."""

    def __init__(self, monkeypatch):
        import diffusers.models.transformers.transformer_kandinsky6_sr as k6
        self.masks, real = [], k6.nabla_block_mask

        def recorded(*a, **kw):
            self.masks.append(real(*a, **kw))
            return self.masks[-1]
        monkeypatch.setattr(k6, "nabla_block_mask", recorded)


@torch.no_grad()
@pytest.mark.parametrize("rows", [512, 1536])
def test_kandinsky6_sr_streams_its_nabla_attention_under_the_stock_mask_exactly(rows, monkeypatch):
    block, args, kwargs = _kandinsky6_sr(rows)
    with streamed(block, chunk_tokens=128, capture="off") as handle:   # the part (the whole block: its own test file)
        nabla = _NablaMasks(monkeypatch)   # after recognition: it checks nabla_block_mask's source
        counted = _Counting(monkeypatch)
        out = block(*args, **kwargs)
        report = handle.report()
        plans = handle.plans["self_attention"]
    ref = block(*args, **kwargs)   # stock, its mask recorded after the streamed call's
    assert plans[0].tier == "L1" and plans[0].chunk == 128, report
    assert "Kandinsky6SRAttention[flex NABLA BlockMask]" in report, report
    assert counted.rows == [128] * (rows // 128), counted.rows
    streamed_mask, stock_mask = nabla.masks[-2:]   # (before them: the failed capture's traced calls)
    assert streamed_mask.kv_num_blocks.device == CPU
    density = stock_mask.to_dense().float().mean()
    assert 0 < density < 1, density   # a sparse choice: the threshold picked some blocks and left others
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(streamed_mask, name), getattr(stock_mask, name)), name
    assert rel_err(out, ref) <= 1e-6
    assert torch.equal(out, ref)   # the same fp32 softmax per query row as the stock call's


@torch.no_grad()
def test_kandinsky6_sr_streamed_peak_is_below_stock():
    block, args, kwargs = _kandinsky6_sr(2048)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=128):
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
    assert torch.equal(out, ref)
    assert peak < 0.35 * stock, (peak, stock)   # uncompiled flex's scores over every key: one chunk's, not all rows'


@torch.no_grad()
def test_kandinsky6_sr_sparse_params_it_does_not_know_stay_stock_named(monkeypatch):
    block, args, kwargs = _kandinsky6_sr(512)
    args = (*args[:3], {**args[3], "block_size": 64})   # a key the processor ignores, streamplan does not know
    ref = block(*args, **kwargs)
    counted = _Counting(monkeypatch)
    with streamed(block, chunk_tokens=128, capture="off") as handle:   # the part's binder
        out = block(*args, **kwargs)
        report = handle.report()
    assert "sparse_params is not {'sta_mask': tensor, 'threshold': number}" in report, report
    assert counted.rows == [] and torch.equal(out, ref)


@torch.no_grad()
def test_kandinsky6_sr_other_processor_stays_stock_named(monkeypatch):
    import diffusers.models.transformers.transformer_kandinsky6_sr as k6

    class Custom(k6.Kandinsky6SRAttnProcessor):
        pass
    block, args, kwargs = _kandinsky6_sr(512)
    block.self_attention.set_processor(Custom())
    ref = block(*args, **kwargs)
    counted = _Counting(monkeypatch)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "its processor is Custom" in report, report
    assert counted.rows == [] and torch.equal(out, ref)


def test_a_mask_built_from_every_row_is_priced_beside_k_and_v():
    """The memory model counts a value built once from every row when K and V are whole: its kept tables through the
    attention, its build's transients (stock's call too) and the whole Q only the streamed call holds for it."""
    from dataclasses import replace

    from streamplan.plan.planner import AttentionDims, Tier, attention_peak
    d = AttentionDims(1, 4096, 4096, 8, 8, 64, 512, 2)
    big = replace(d, built_held=3_000, built_transient=50_000_000, built_inputs=4096 * 8 * 64 * 2)
    kv, out = 2 * 4096 * 512 * 2, 4096 * 512 * 2
    assert attention_peak(big, Tier.L1, 128) == kv + out + 3_000 + 50_000_000 + 4096 * 8 * 64 * 2
    assert attention_peak(big, Tier.L0, 4096) == attention_peak(d, Tier.L0, 4096) + 3_000 + 50_000_000
    assert attention_peak(replace(d, built_held=3_000), Tier.L1, 128) == attention_peak(d, Tier.L1, 128) + 3_000


@torch.no_grad()
def test_kandinsky6_sr_declares_its_mask_build_to_the_memory_model():
    from streamplan.integrations.diffusers.flex_nabla import recognize_nabla_attention
    block, args, kwargs = _kandinsky6_sr(1024)
    spec = recognize_nabla_attention("self_attention", block.self_attention)
    seen = {}
    original = block.self_attention.forward

    def grab(*a, **k):
        seen["call"] = spec.bind(a, k)
        return original(*a, **k)

    block.self_attention.forward = grab
    try:
        block(*args, **kwargs)
    finally:
        del block.self_attention.forward
    call = seen["call"]
    pairs = call.batch * call.heads * (call.rows // 64) ** 2
    assert call.built_inputs == call.batch * call.rows * call.heads * call.head_dim * 4   # fp32 Q of every row
    assert call.built_held == 4 * pairs and call.built_transient == (2 * 4 + 24) * pairs
