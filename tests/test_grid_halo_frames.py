"""Rows on a grid of frames x lines x width (a video's latent, rows in frame-major order, ``row = (f*H + h)*W + w``,
the frame count, height and width passed as ints): captured with the row count as ``height * width * frames``,
frames symbolic, so chunks are whole frames. A spatial convolution over each frame (the frames its batch) reads no
neighbouring rows; a temporal convolution over the frames reads whole frames around each of its own, its reach read
off its kernel size, padding and dilation along the frames, never guessed; each chunk runs widened by that halo and
keeps its own frames. A batch merged in front of the frames (``view(batch * frames, ...)``) is followed as runs of whole
frames, one per batch item: convolved as a batch, never along. Against diffusers' own ``SanaVideoTransformerBlock``
(linear attention, then an MLP with a 3x3 convolution over each frame and a 3x1 convolution over the frames)."""
import pytest
import torch
from torch import nn

import streamplan
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable

pytest.importorskip("diffusers")

CPU = torch.device("cpu")


def _video(frames: int, height: int, width: int, batch: int = 1):
    """The catalogue's tiny Sana-Video block and a call as the model makes it: ``frames x height x width`` rows, the
    text key bias of a padded prompt, float64 rotary tables (one for every batch item, as its rotary module gives)."""
    from streamplan.tools.catalogue.diffusers_cases import CASES, TEXT
    torch.manual_seed(0)
    block = CASES["sana_video"].build()
    n = frames * height * width
    bias = torch.zeros(batch, 1, TEXT)
    bias[..., TEXT - 3:] = -10000.0
    rotary = tuple(torch.randn(1, n, 1, 16, dtype=torch.float64) for _ in range(2))
    kwargs = dict(encoder_hidden_states=torch.randn(batch, TEXT, 64), encoder_attention_mask=bias,
                  timestep=torch.randn(batch, 1, 6 * 64), frames=frames, height=height, width=width,
                  rotary_emb=rotary)
    return block, (torch.randn(batch, n, 64),), kwargs


@pytest.mark.parametrize("frames,height,width,chunk,batch", [
    (7, 6, 10, 150, 1),    # 60 rows a frame: chunks of 2 frames (120 rows), the last one frame
    (5, 9, 7, 100, 1),     # an odd frame of 63 rows: chunks of two frames, the fewest the capture holds
    (6, 7, 5, 80, 1),      # 35 rows a frame: chunks of 2 frames, 6 frames in 3 chunks
    # classifier-free guidance's batch of two: the MLP merges the batch into the frames (``view(batch * frames, ..)``)
    # for its convolution over each frame, and splits them again before the one over the frames
    (7, 6, 10, 150, 2),
    (5, 9, 7, 100, 3),
])
@torch.no_grad()
def test_sana_video_block_streams_in_whole_frames_with_a_halo_of_one_frame(frames, height, width, chunk, batch):
    block, args, kwargs = _video(frames, height, width, batch)
    ref = block(*args, **kwargs)
    found, _ = streamable(block, args, kwargs, frames * height * width)
    frame = height * width
    assert found.captured.row_unit == frame                 # rows = frame * frames, the frame count symbolic
    assert found.analysis.halo == (frame, frame)            # the 3x1 temporal convolution: a frame either side
    assert len(found.analysis.contractions) == 2            # linear attention's sum of K and V^T K, over every row
    with streamed(block, chunk_tokens=chunk) as handle:
        out = block(*args, **kwargs)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1" and plan.chunk % frame == 0 and plan.chunk < frames * frame, handle.report()
        # the most whole frames in what was asked, and never under two (the capture's frame count is symbolic from 2)
        assert plan.chunk == max(2 * frame, chunk // frame * frame), handle.report()
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5


@torch.no_grad()
def test_one_frame_streams_by_lines():
    """One frame (Sana-Video making an image): the grid is the plane (lines of the width), the 3x3 convolution reads a
    line either side, and the temporal convolution over the one frame reads no other row."""
    block, args, kwargs = _video(1, 12, 10)
    ref = block(*args, **kwargs)
    found, _ = streamable(block, args, kwargs, 120)
    assert found.captured.row_unit == 10 and found.analysis.halo == (10, 10)
    with streamed(block, chunk_tokens=30) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1" and handle.plans[""][0].chunk == 30, handle.report()
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("conv,halo_frames", [
    (dict(kernel_size=(5, 1), padding=(4, 0), dilation=(2, 1)), (4, 4)),   # reach 8 frames, centred
    (dict(kernel_size=(4, 1), padding="same"), (1, 2)),                     # an even kernel: one before, two after
])
@torch.no_grad()
def test_the_temporal_reach_is_read_off_the_convolution(conv, halo_frames):
    """The block's own temporal convolution swapped for a wider one: the halo is its reach along the frames."""
    frames, height, width = 11, 4, 6
    block, args, kwargs = _video(frames, height, width)
    block.ff.conv_temp = nn.Conv2d(64, 64, bias=False, **conv)
    ref = block(*args, **kwargs)
    found, _ = streamable(block, args, kwargs, frames * height * width)
    assert found.analysis.halo == (halo_frames[0] * 24, halo_frames[1] * 24)
    with streamed(block, chunk_tokens=48) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1" and handle.plans[""][0].chunk == 48, handle.report()
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_streamed_peak_is_below_stock_and_grows_slower_with_frames(batch):
    from streamplan.graph.memory import graph_memory
    peaks, stocks = [], []
    for frames in (8, 16, 32):
        block, args, kwargs = _video(frames, 16, 16, batch)
        rows = frames * 256
        ref, stock_peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
        with streamed(block, chunk_tokens=512) as handle:
            out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
            (plan,) = handle.plans[""]
            assert plan.tier == "L1" and plan.chunk == 512, handle.report()
        assert rel_err(out, ref) <= 1e-5
        found, _ = streamable(block, args, kwargs, rows)
        # what must exist at once: the output, and linear attention's operands built whole over every row (its K and V)
        floor = graph_memory(found.analysis, found.phases, rows, set()).kv_bytes + out.numel() * 4
        assert peak < 0.6 * stock_peak, (frames, peak, stock_peak)
        assert frames < 32 or peak <= 1.25 * floor, (peak, floor)   # the chunk's share is small by then
        peaks.append(peak)
        stocks.append(stock_peak)
    # per added row: stock holds the MLP's hidden values (about 13 residuals' worth at this width), the stream the
    # output and linear attention's operands (at most 4: a chunk's share is the same at every length)
    for i in (1, 2):
        assert peaks[i] - peaks[i - 1] < 0.4 * (stocks[i] - stocks[i - 1]), (peaks, stocks)


@torch.no_grad()
def test_one_capture_serves_every_frame_count():
    block, args, kwargs = _video(6, 5, 8)
    found, fresh = streamable(block, args, kwargs, 240)
    assert not isinstance(found, str) and fresh, found
    block2, args2, kwargs2 = _video(9, 5, 8)
    again, fresh2 = streamable(block2, args2, kwargs2, 360)
    assert again is found and not fresh2
    ref = block2(*args2, **kwargs2)
    with streamed(block2, chunk_tokens=80) as handle:
        out = block2(*args2, **kwargs2)
        assert handle.plans[""][0].tier == "L1", handle.report()
    assert rel_err(out, ref) <= 1e-5


class _Strided(nn.Module):
    """A temporal convolution with a stride of 2 over the frames, its frames put back by repeating each."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 64, (3, 1), stride=(2, 1), padding=(1, 0), bias=False)

    def forward(self, x):
        return self.conv(x).repeat_interleave(2, dim=2)


class _AcrossTheBatch(nn.Module):
    """Frames merged with the batch (``view(batch * frames, ...)``), then convolved along that merged dimension: its
    kernel reads the last frame of one batch item beside the first of the next."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.conv = nn.Conv2d(16, 16, (3, 1), padding=(1, 0))

    def forward(self, x, frames: int, height: int, width: int):
        b, n, _ = x.shape
        h = self.up(x).unflatten(1, (frames, height, width)).reshape(b * frames, height * width, 16).permute(2, 0, 1)
        h = self.conv(h[None])[0]
        return x + self.down(h.permute(1, 2, 0).reshape(b, n, 16))


class _Causal(nn.Module):
    """A causal temporal convolution: padded by two frames each side, its last two output frames dropped."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 64, (3, 1), padding=(2, 0), bias=False)

    def forward(self, x):
        return self.conv(x)[:, :, :-2]


@pytest.mark.parametrize("conv_temp,batch,reason", [
    (_Strided, 1, "with a stride of 2 along its lines"),
    (_Causal, 1, "whose output is not its input's size along its lines"),
    (lambda: nn.Conv2d(64, 64, (3, 1), padding=(1, 0), bias=False, padding_mode="replicate"), 1,
     "of a value laid out as the rows' grid"),
])
@torch.no_grad()
def test_what_the_frames_halo_cannot_prove_stays_stock_named(conv_temp, batch, reason):
    block, args, kwargs = _video(6, 4, 5, batch)
    if conv_temp is not None:
        block.ff.conv_temp = conv_temp()
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=40) as handle:
        out = block(*args, **kwargs)
        assert not [p for p in handle.plans.get("", []) if p.tier != "L0"], handle.report()
        assert reason in handle.report(), handle.report()
    assert torch.equal(out, ref)


@torch.no_grad()
def test_a_convolution_along_frames_merged_with_the_batch_stays_stock_named():
    torch.manual_seed(0)
    block = _AcrossTheBatch().eval()
    x = torch.randn(2, 6 * 4 * 5, 8)
    ref = block(x, 6, 4, 5)
    with streamed(block, chunk_tokens=40, capture="prefer") as handle:
        out = block(x, 6, 4, 5)
        assert not [p for p in handle.plans.get("", []) if p.tier != "L0"], handle.report()
        assert "whose lines are merged with a static dimension" in handle.report(), handle.report()
    assert torch.equal(out, ref)
