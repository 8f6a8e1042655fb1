"""Masks over rows x rows a block builds inside itself, each Q chunk's rows built alone (``graph/pair_masks.py``):
HunyuanVideo 1.5's processor pads the text mask over the image rows, repeats it over every query row and ands it with
its transpose; Lumina-Next's expands a [B, N] key mask to [B, H, N, N]; the token refiners' blocks repeat a given
[B, 1, N, N] mask over the heads. Against each block's own forward, fp32 on CPU."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from conftest import streamed  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

CPU = torch.device("cpu")


def _rel(out, ref) -> float:
    worst = 0.0
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        assert torch.equal(torch.isnan(o), torch.isnan(r))
        keep = ~torch.isnan(r)
        worst = max(worst, ((o - r)[keep].abs().max() / r[keep].abs().max()).item())
    return worst


def _hunyuan15(n: int, padded: int = 3):
    """The block and a call as HunyuanVideo 1.5's model forward makes it: the text mask's valid tokens first, the
    padding after them (its reordering), ``padded`` of them."""
    case = CASES["hunyuan_video15"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(n, CPU, torch.float32)
    mask = torch.ones_like(args[3])
    if padded:
        mask[:, -padded:] = False
    return block, (*args[:3], mask, *args[4:]), kwargs


@torch.no_grad()
def test_hunyuan_video15_streams_with_its_padded_text_mask_exactly_and_far_below_stock():
    n, chunk = 2048, 256
    block, args, kwargs = _hunyuan15(n)
    ref, stock_peak = streamplan.measure_peak(lambda: block(*args, **kwargs))
    unpadded = block(*args[:3], torch.ones_like(args[3]), *args[4:])
    assert _rel(unpadded, ref) > 1e-4   # the padding really changes the output: the mask is applied

    found, _ = streamable(block, args, kwargs, n)
    assert len(found.analysis.pair_masks) == 1, found.analysis.pair_masks
    with streamed(block, chunk_tokens=chunk) as handle:
        block(*args, **kwargs)   # the capture, outside the measurement
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs))
        plan = handle.plans[""][0]
        assert plan.tier == "L1" and plan.chunk == chunk, handle.report()
        assert "1 mask(s) over rows x rows built inside the block" in handle.report(), handle.report()
        assert _rel(out, ref) <= 1e-5
        # stock holds the [S, S] mask (and its copies); a chunk holds its rows of it at most
        assert peak <= 0.2 * stock_peak, (peak, stock_peak)
        assert peak <= plan.predicted_peak, (peak, plan.predicted_peak)


@torch.no_grad()
def test_a_chunks_mask_rows_do_not_grow_with_the_rows_squared():
    """Twice the rows: stock's peak grows about fourfold with its [S, S] mask; the streamed peak about twofold (K/V,
    the output, the chunk's mask rows over twice the keys)."""
    peaks, stock = [], []
    for n in (1024, 2048):
        block, args, kwargs = _hunyuan15(n)
        stock.append(streamplan.measure_peak(lambda: block(*args, **kwargs))[1])
        with streamed(block, chunk_tokens=128):
            block(*args, **kwargs)
            peaks.append(streamplan.measure_peak(lambda: block(*args, **kwargs))[1])
    assert stock[1] / stock[0] > 3.0, stock
    assert peaks[1] / peaks[0] < 2.3, peaks


@pytest.mark.parametrize("name", ["lumina_next", "hunyuan_video15_refiner_block", "hunyuan_video_refiner_block"])
@torch.no_grad()
def test_masks_spread_over_rows_x_rows_stream_exactly(name):
    """Lumina-Next expands its [B, N] key mask over the query rows and heads; the refiners' blocks repeat a given
    [B, 1, N, N] mask over the heads (diffusers' prepare_attention_mask)."""
    case = CASES[name]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(300, CPU, torch.float32)
    ref = block(*args, **kwargs)
    found, _ = streamable(block, args, kwargs, 300)
    assert len(found.analysis.pair_masks) == 1
    with streamed(block, chunk_tokens=64, capture="prefer") as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert _rel(out, ref) <= 1e-5


class _MaskFromTheRows(nn.Module):
    """A key mask computed from the rows' own values (a sum over features), spread over rows x rows: not built from
    values read whole, so the block must stay stock."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        keep = x.sum(-1) > 0
        mask = keep[:, None, None, :].expand(-1, 2, x.shape[1], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch.no_grad()
def test_a_mask_over_rows_x_rows_from_the_rows_values_is_refused_named():
    torch.manual_seed(0)
    x = torch.randn(1, 256, 32)
    found, _ = streamable(_MaskFromTheRows().eval(), (x,), {}, 256)
    assert isinstance(found, str) and "sum on the way to a mask over rows x rows" in found, found


@torch.no_grad()
def test_a_key_mask_the_block_unsqueezes_from_its_input_is_built_whole_for_each_chunk():
    """LongCat-Audio-DiT's block takes the pipeline's [B, N] audio mask, unsqueezes it to [B, 1, 1, N] for the
    attention's keys and multiplies its rows by it after: padded audio rows (the last 40) masked as keys, exactly."""
    case = CASES["longcat_audio_dit"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(300, CPU, torch.float32)
    kwargs = dict(kwargs, mask=kwargs["mask"].clone())
    kwargs["mask"][:, -40:] = False
    ref = block(*args, **kwargs)
    assert _rel(block(*args, **dict(kwargs, mask=torch.ones_like(kwargs["mask"]))), ref) > 1e-4   # it is applied
    found, _ = streamable(block, args, kwargs, 300)
    assert len(found.analysis.pair_masks) == 1 and found.analysis.whole_inputs, found.analysis
    with streamed(block, chunk_tokens=64) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert _rel(out, ref) <= 1e-5
