"""Sana-WM's blocks take their grid as one ``(frames, height, width)`` tuple: found like the separate ints are
(``grid_rows.grid_of_call``), so the capture holds the frames symbolic. diffusers' own ``GLUMBConvTemp`` (a 3x3
convolution over each frame, then a 3x1 one over the frames; between two linears, so the generic path takes it) streams
in chunks of whole frames with a halo of one frame; its loop over fixed-size pieces of the frames, run once in the
trace, is a slice that keeps every frame, and the capture holds only up to that many frames (``Captured.max_rows``).
The block itself (``SanaVideoMSCamCtrlBlock``, with its softmax-attention layer and with its gated delta-rule one)
reads its frame count off its per-frame modulation (``t``: ``[B, 1, frames, 6C]``), not off the rows or the tuple: the
capture holds the frames at the call's count, the ``view(B, frames, -1, C)`` of the rows splits them into that fixed
count of runs, and the block stays stock with that named."""
import pytest
import torch
from torch import nn

import streamplan
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable
from streamplan.graph.grid_rows import Grid, grid_of_call

pytest.importorskip("diffusers")

CPU = torch.device("cpu")


def test_a_grid_given_as_one_tuple_is_found():
    x = torch.zeros(1, 60, 8)
    assert grid_of_call({"x": x, "HW": (3, 4, 5)}, 60) == Grid("HW", 20, 0)
    assert grid_of_call({"x": x, "HW": (3, 4, 5)}, 61) is None          # extents that are not the rows
    assert grid_of_call({"x": x, "HW": (1, 6, 10)}, 60) is None         # one frame: no line count to vary
    assert grid_of_call({"x": x, "HW": (3, 4, 5), "h": 6, "w": 10}, 60) is None   # two grids: ambiguous


class _FramesMLP(nn.Module):
    """diffusers' own ``GLUMBConvTemp`` between two linears (a block the generic path takes: two linear layers), its
    grid given as one ``(frames, height, width)`` tuple, as Sana-WM's block passes it."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_sana_wm import GLUMBConvTemp
        self.inp = nn.Linear(64, 64)
        self.mlp = GLUMBConvTemp(64, 160, use_bias=(True, True, False), act=("silu", "silu", None), t_kernel_size=3)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, HW: tuple[int, int, int]) -> torch.Tensor:
        return self.out(self.mlp(self.inp(x), HW=HW))


def _mlp(frames: int, height: int, width: int):
    torch.manual_seed(0)
    return _FramesMLP().eval(), (torch.randn(1, frames * height * width, 64),), {"HW": (frames, height, width)}


@pytest.mark.parametrize("frames,height,width,chunk", [(8, 16, 16, 512), (7, 6, 10, 150)])
@torch.no_grad()
def test_its_temporal_mlp_streams_in_whole_frames_from_the_tuple(frames, height, width, chunk):
    from diffusers.models.transformers import transformer_sana_wm as wm
    mlp, args, kwargs = _mlp(frames, height, width)
    rows, frame = frames * height * width, height * width
    ref, stock_peak = streamplan.measure_peak(lambda: mlp(*args, **kwargs), device=CPU)
    found, _ = streamable(mlp, args, kwargs, rows)
    assert not isinstance(found, str), found
    assert found.captured.row_unit == frame                 # the frame count symbolic, read off the rows
    assert found.analysis.halo == (frame, frame)            # the 3x1 convolution over the frames: one either side
    # its loop over pieces of ``per_call`` frames ran once in the trace (``x[0:per_call]``, every frame): the capture
    # holds for fewer frames than that, and a call with more runs stock
    per_call = wm._INT32_SAFE_CONV_ELEMENTS // (320 * frame)
    assert found.captured.max_rows is not None and frames * frame <= found.captured.max_rows <= per_call * frame
    assert not found.captured.holds_for(per_call * frame + frame)
    with streamed(mlp, chunk_tokens=chunk) as handle:
        out, peak = streamplan.measure_peak(lambda: mlp(*args, **kwargs), device=CPU)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1" and plan.chunk % frame == 0 and plan.chunk < rows, handle.report()
    assert rel_err(out, ref) <= 1e-5
    assert peak < stock_peak, (peak, stock_peak)      # stock holds the [rows, 320] hidden values at once


def _block(attn: str):
    from streamplan.tools.catalogue.diffusers_cases import CASES, _cls
    case = CASES["sana_wm"]
    torch.manual_seed(0)
    if attn == "softmax":
        block = case.build()
    else:   # the catalogue's block with the layer kind the other three of every four use
        from diffusers.models.transformers import transformer_sana_wm as wm
        block = _cls(case.cls_path)(64, 4, wm.BidirectionalGDNUCPESinglePathLiteLA, mlp_ratio=3.0, qk_norm=True,
                                    ffn_type="GLUMBConvTemp", linear_head_dim=16, cross_norm=True,
                                    patch_size=(1, 1, 1), cam_attn_compress=1, use_chunk_plucker_post_attn=True,
                                    conv_kernel_size=4, k_conv_only=True).eval()
    args, kwargs = case.inputs(400, CPU, torch.float32)
    return block, args, kwargs


@pytest.mark.parametrize("attn", ["softmax", "delta_rule"])
@torch.no_grad()
def test_the_block_reads_its_frames_off_its_modulation_and_stays_stock_named(attn):
    block, args, kwargs = _block(attn)
    ref = block(*args, **kwargs)
    found, _ = streamable(block, args, kwargs, 400)
    assert isinstance(found, str) and "captured in" in found, found    # the capture holds; the analysis refuses
    assert "reshape splits the rows into 4 runs in front of them" in found, found
    with streamed(block, capture="prefer", chunk_tokens=100) as handle:
        out = block(*args, **kwargs)
        assert not [p for p in handle.plans.get("", []) if p.tier != "L0"], handle.report()
        assert "splits the rows into 4 runs" in handle.report(), handle.report()
    assert torch.equal(out, ref)
