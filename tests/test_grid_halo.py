"""Rows laid out on a grid (an image plane's height and width passed as ints): captured with the row count as
``width * lines``, chunks of whole lines, and a convolution over the plane streamed by widening each chunk by the
whole lines its kernel reaches (read off its kernel size, padding and dilation and the static width, never guessed);
in blocks with a global attention too, whose phase KV stays unwidened. Against diffusers' own Sana block."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamplan
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable

pytest.importorskip("diffusers")

CPU = torch.device("cpu")


def _sana(height: int, width: int):
    from streamplan.tools.catalogue.diffusers_cases import CASES, _r, _txt, _x
    torch.manual_seed(0)
    block = CASES["sana"].build()
    n = height * width
    args = (_x(n, CPU, torch.float32),)
    kwargs = dict(encoder_hidden_states=_txt(CPU, torch.float32), timestep=_r(1, 6 * 64, device=CPU,
                                                                             dtype=torch.float32),
                  height=height, width=width)
    return block, args, kwargs


@torch.no_grad()
def test_sana_block_streams_exactly_below_stock_and_near_its_floor():
    block, args, kwargs = _sana(100, 40)
    ref, stock_peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
    found, _ = streamable(block, args, kwargs, 4000)
    assert found.captured.row_unit == 40                 # rows = 40 * lines, the line count symbolic
    assert found.analysis.halo == (40, 40)               # the 3x3 convolution: one whole line above and below
    assert len(found.analysis.contractions) == 1         # linear attention's state, over every row
    with streamed(block, chunk_tokens=400) as handle:
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1" and plan.chunk == 400, handle.report()
        assert rel_err(out, ref) <= 1e-5
    floor = 3 * args[0].numel() * 4                      # residual + K + V (the attention's inner width is the block's)
    assert peak < 0.5 * stock_peak, (peak, stock_peak)
    assert peak <= 1.6 * floor, (peak / floor, stock_peak / floor)


@pytest.mark.parametrize("height,width,chunk", [(37, 32, 100), (8, 24, 30), (50, 20, 410)])
@torch.no_grad()
def test_sana_chunks_are_whole_lines_whatever_is_asked(height, width, chunk):
    block, args, kwargs = _sana(height, width)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=chunk) as handle:
        out = block(*args, **kwargs)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1" and plan.chunk % width == 0, handle.report()
        assert rel_err(out, ref) <= 1e-5


class _PlaneBlock(nn.Module):
    """Self-attention over the rows, then an MLP with a depthwise convolution over the image plane (``kernel``,
    ``padding``, ``dilation``, ``stride`` as given); ``conv_first`` runs the convolution before the attention, so its
    K and V read it."""

    def __init__(self, kernel=3, padding=1, dilation=1, stride=1, conv_first=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.up, self.down = nn.Conv2d(32, 64, 1), nn.Conv2d(64, 32, 1)
        self.depth = nn.Conv2d(64, 64, kernel, stride, padding, dilation, groups=64)
        self.conv_first = conv_first

    def mlp(self, x, height, width):
        h = x.unflatten(1, (height, width)).permute(0, 3, 1, 2)
        h = self.down(F.silu(self.depth(self.up(h))))
        return x + h.flatten(2, 3).permute(0, 2, 1)

    def forward(self, x, height: int, width: int):
        if self.conv_first:
            x = self.mlp(x, height, width)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x if self.conv_first else self.mlp(x, height, width)


@pytest.mark.parametrize("kernel,padding,dilation,lines", [(3, 1, 1, 1), (5, 4, 2, 4), (3, "same", 1, 1)])
@torch.no_grad()
def test_a_plane_convolution_after_a_global_attention_streams_with_its_halo(kernel, padding, dilation, lines):
    torch.manual_seed(0)
    block = _PlaneBlock(kernel, padding, dilation).eval()
    height, width = 30, 12
    x = torch.randn(1, height * width, 32)
    ref = block(x, height, width)
    found, _ = streamable(block, (x, height, width), {}, height * width)
    assert found.analysis.halo == (lines * width, lines * width)
    assert len(found.analysis.attentions) == 1
    with streamed(block, chunk_tokens=48) as handle:
        out = block(x, height, width)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("kwargs,reason", [
    (dict(kernel=3, padding=0), "whose output is not its input's size"),
    (dict(kernel=3, padding=1, stride=2), "with a stride"),
    (dict(kernel=3, padding=1, conv_first=True), "feeding its K or V"),
])
@torch.no_grad()
def test_a_plane_convolution_whose_reach_is_not_proved_stays_stock_named(kwargs, reason):
    torch.manual_seed(0)
    block = _PlaneBlock(**kwargs).eval()
    height, width = 30, 12
    x = torch.randn(1, height * width, 32)
    if kwargs.get("padding") == 0 or kwargs.get("stride", 1) > 1:   # the MLP's output no longer has the rows' count
        block.mlp = lambda x, height, width: x + F.interpolate(
            block.down(F.silu(block.depth(block.up(x.unflatten(1, (height, width)).permute(0, 3, 1, 2))))),
            size=(height, width)).flatten(2, 3).permute(0, 2, 1)
    ref = block(x, height, width)
    with streamed(block, chunk_tokens=48) as handle:
        out = block(x, height, width)
        assert not [p for p in handle.plans.get("", []) if p.tier != "L0"], handle.report()
        assert reason in handle.report(), handle.report()
        assert torch.equal(out, ref)


@torch.no_grad()
def test_one_capture_serves_every_height_of_a_grid():
    """The line count is computed from the rows in the capture, so a second height reuses the first's capture
    (the signature holds "lines" where the height was), and streams exactly."""
    block, args, kwargs = _sana(100, 40)
    found, fresh = streamable(block, args, kwargs, 4000)
    assert not isinstance(found, str), found
    block2, args2, kwargs2 = _sana(60, 40)
    again, fresh2 = streamable(block2, args2, kwargs2, 2400)
    assert again is found and not fresh2
    ref = block2(*args2, **kwargs2)
    with streamed(block2, chunk_tokens=400) as handle:
        out = block2(*args2, **kwargs2)
        assert handle.plans[""][0].tier == "L1", handle.report()
    assert rel_err(out, ref) <= 1e-5
    _, _, other = _sana(40, 60)   # another width: another capture
    assert streamable(block2, _sana(40, 60)[1], other, 2400)[0] is not found
