"""streamplan.integrations.comfy's streamed Wan forward under Wan 2.2 TI2V's per-frame timesteps: a tiny random-weight
``WanModel`` in a real ``WAN22`` ``BaseModel`` and ``ModelPatcher`` (as ComfyUI builds TI2V-5B: a t2v Wan whose
``process_timestep`` turns the sampler's ``denoise_mask`` into one timestep per latent frame, the first 0 for
image-to-video), called as ComfyUI's samplers call it, against the model's own stock forward."""
from __future__ import annotations

import copy

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import CPU, batch_call, _block_lines, _config, _conds, _forwards_installed, _random_, fresh_captures

__all__ = ["fresh_captures"]   # the fixture, used by name

DIM, HEADS, FFN, CHANNELS, TEXT = 64, 4, 128, 4, 7


def wan22_patcher(layers: int = 2):
    comfy = comfyui()
    unet = {"image_model": "wan2.1", "model_type": "t2v", "dim": DIM, "ffn_dim": FFN, "num_heads": HEADS,
            "num_layers": layers, "in_dim": CHANNELS, "out_dim": CHANNELS, "text_dim": 32, "freq_dim": 32,
            "eps": 1e-6, "patch_size": (1, 2, 2)}
    base = comfy.model_base.WAN22(_config(comfy, unet, comfy.latent_formats.Wan22), image_to_video=True)
    _random_(base)
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)


def wan22_call(patcher, frames: int = 3, hw: int = 32, frame_mask=None, batch: int = 1, seed: int = 0):
    """(x, cond) as ComfyUI's sampler hands them: a ``[batch, 4, frames, hw, hw]`` latent and the model's own
    ``extra_conds``; with ``frame_mask`` (``[frames]`` or ``[batch, frames]``) the noise mask Wan22ImageToVideoLatent
    makes (one value per latent frame), brought to the latent's shape as the sampler's ``prepare_mask`` does, from
    which ``WAN22.process_timestep`` makes one timestep per frame. None: no mask (one timestep per entry)."""
    comfy = comfyui()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, CHANNELS, frames, hw, hw, generator=g)
    kw = dict(noise=x, cross_attn=torch.randn(batch, TEXT, 32, generator=g))
    if frame_mask is not None:
        mask = frame_mask.reshape(-1, 1, frames, 1, 1).expand(-1, 1, frames, hw, hw)
        kw["denoise_mask"] = comfy.utils.reshape_mask(mask, x.shape)
    return x, _conds(patcher.model, **kw)


def _timesteps(patcher, x, cond) -> torch.Tensor:
    """The timestep the diffusion model receives (``process_timestep`` on the sampler's)."""
    t = patcher.model.model_sampling.timestep(torch.full((x.shape[0],), 0.7)).float()
    return patcher.model.process_timestep(t, x=x, **cond)


def _streamed_fully(text: str, blocks: int, chunk: int) -> None:
    assert f"1 call(s) streamed (input projection and output head in {chunk}-row chunks, " \
           f"{blocks} block input(s) donated in the last)" in text, text
    sections = _block_lines(text)
    for i in range(blocks):
        section = sections[f"double_block.{i}"]
        assert "1 call(s) through the streamer" in section and " L1 " in section, text
    assert "ran stock" not in text and "built whole" not in text, text


FIRST_CLEAN = torch.tensor([0.0, 1.0, 1.0])            # Wan22ImageToVideoLatent with a start image
PER_FRAME = torch.tensor([0.0, 0.25, 1.0])              # a distinct timestep on every frame


@pytest.mark.parametrize("case", ["image-to-video", "distinct per frame", "cond + uncond batch", "text-to-video"])
def test_wan22_streams_exactly(fresh_captures, case):
    """The whole apply_model call through patch(): under per-frame timesteps every block's six modulations reach its
    streamed call as a per-row table described a chunk's rows at a time (``e`` with a row per row in the report), the
    head's shift and scale picked per chunk from the frames', the block inputs donated, every block streamed from its
    captured graph: within fp32 rel 1e-5 of ComfyUI's own forward; the base patcher and the shared model as they
    were. The cond + uncond batch has a different mask per entry; text-to-video (no mask) one timestep per entry."""
    import streamplan.integrations.comfy as sc
    base = wan22_patcher()
    mask = {"image-to-video": FIRST_CLEAN, "distinct per frame": PER_FRAME, "text-to-video": None,
            "cond + uncond batch": torch.stack([FIRST_CLEAN, PER_FRAME])}[case]
    batch = 2 if case == "cond + uncond batch" else 1
    x, cond = wan22_call(base, frame_mask=mask, batch=batch)
    t = _timesteps(base, x, cond)
    if mask is None:
        assert t.shape == (batch,)
    else:   # WAN22's own per-frame timesteps: [batch, frames], the mask's values times the step's timestep
        assert t.shape == (batch, 3) and torch.equal(t == 0, mask.reshape(batch, 3) == 0), t
    before = copy.copy(base.model_options["transformer_options"])
    stock = batch_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out = batch_call(patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    text = sc.report(patched)
    _streamed_fully(text, 2, 64)
    rows = 3 * 16 * 16
    e_rows = 1 if mask is None else rows
    assert text.count(f"e=({batch}, {e_rows}, 6, {DIM})") == 2, text
    assert base.model_options["transformer_options"] == before
    assert _forwards_installed(base.model) == []


def test_wan22_same_clone_with_and_without_a_mask(fresh_captures):
    """One patched clone called with an image-to-video latent, a text-to-video one (one timestep per entry) and one
    with a distinct timestep per frame: the blocks stream every call (a capture per table shape), each exact."""
    import streamplan.integrations.comfy as sc
    base = wan22_patcher(layers=1)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    for mask in (FIRST_CLEAN, None, PER_FRAME):
        x, cond = wan22_call(base, frame_mask=mask, seed=int(mask is None))
        assert rel_err(batch_call(patched, x, cond), batch_call(base, x, cond)) <= 1e-5
    text = sc.report(patched)
    assert "3 call(s) streamed" in text and "3 call(s) through the streamer" in text, text
    assert "ran stock" not in text and "built whole" not in text, text


def test_wan22_table_is_never_whole(fresh_captures):
    """The peak grows with the rows under per-frame timesteps as it does under one timestep per entry, near the
    blocks' floor: the per-row modulation table (6 x 64 fp32 values a row, 1.7x the floor) is never built over every
    row, by the forward or a block. Stock builds each modulation over every row in its blocks (repeat_e) and in its
    head. Measured at 256-row chunks, 1024 -> 1536 rows: the streamed peak grows 1.08x the floor's growth per frame,
    1.07x under one timestep (stock 2.25x and 2.23x; 1536 rows per frame: stock 3.99 MiB, streamed 2.56 MiB; the
    0.75 MiB beside the scalar case's is a chunk's table rows, picked and modulated, in the block)."""
    import streamplan.integrations.comfy as sc
    base = wan22_patcher()
    patched = sc.patch(base, budget=None, chunk_tokens=256, min_tokens=0)
    floor_row = 3 * DIM * 4 + DIM // HEADS * 2 * 4    # residual, K, V and the rope table the blocks read, fp32
    table_row = 6 * DIM * 4
    growth, stock_growth, lines = {}, {}, []
    for per_frame in (True, False):
        peaks, stock_peaks = [], []
        for frames in (4, 6):
            mask = torch.linspace(0, 1, frames) if per_frame else None
            x, cond = wan22_call(base, frames=frames, frame_mask=mask, seed=frames)
            assert _timesteps(base, x, cond).numel() == (frames if per_frame else 1)
            stock, stock_peak = streamplan.measure_peak(batch_call, base, x, cond)
            out, peak = streamplan.measure_peak(batch_call, patched, x, cond)
            assert rel_err(out, stock) <= 1e-5
            peaks.append(peak)
            stock_peaks.append(stock_peak)
            lines.append(f"{'per-frame' if per_frame else 'scalar'} {frames * 256} rows: stock "
                         f"{stock_peak / 2**20:.2f} MiB, streamed {peak / 2**20:.2f} MiB")
        growth[per_frame] = (peaks[1] - peaks[0]) / (2 * 256)
        stock_growth[per_frame] = (stock_peaks[1] - stock_peaks[0]) / (2 * 256)
    print("\n".join(lines), {k: round(v / floor_row, 2) for k, v in growth.items()},
          {k: round(v / floor_row, 2) for k, v in stock_growth.items()})
    # the table whole would add at least table_row a row; one of its six modulations whole, a quarter of that
    assert growth[True] - growth[False] <= table_row / 8, (growth, table_row)
    assert growth[True] <= 1.25 * floor_row and growth[False] <= 1.25 * floor_row, (growth, floor_row)
    assert stock_growth[True] >= 1.75 * growth[True], (stock_growth, growth)
    text = sc.report(patched)
    assert "4 call(s) streamed" in text and "ran stock" not in text and "built whole" not in text, text

    # the head runs after the blocks' K/V are gone, where its tables whole would not raise the peak: no op of the
    # streamed call makes a tensor over every row as wide as the table or as one of its modulations (the block
    # captures' stand-ins for the described table are meta or fake tensors; the hidden states' buffer is ``empty``)
    x, cond = wan22_call(base, frames=4, frame_mask=torch.linspace(0, 1, 4))
    made = _wide_tensors(lambda: batch_call(patched, x, cond), rows=4 * 256)
    assert made == {"aten.empty.memory_format": 1}, made


def _wide_tensors(fn, rows: int) -> dict[str, int]:
    """The ops ``fn`` runs that make a ``[batch, rows, 6, DIM]`` or ``[batch, rows, DIM]`` tensor with memory (not a
    meta or fake one: a capture's stand-in)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import TorchDispatchMode
    made: dict[str, int] = {}

    class Wide(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                wide = isinstance(t, torch.Tensor) and tuple(t.shape[1:]) in ((rows, 6, DIM), (rows, DIM))
                if wide and not (t.is_meta or is_fake(t)):
                    made[str(func)] = made.get(str(func), 0) + 1
            return out

    with Wide():
        fn()
    return made


def test_wan22_stock_blocks_take_the_frames_table(fresh_captures):
    """Where a block runs stock under the streamed forward (another node's replacement, a call under min_tokens) it
    gets the per-frame table the stock forward hands it (its own repeat_e lays it over the rows): exact, the forward
    still streamed."""
    import streamplan.integrations.comfy as sc
    base = wan22_patcher()
    seen = []

    def foreign(args, extra):
        seen.append((type(args["vec"]).__name__, tuple(args["vec"].shape)))
        return extra["original_block"](args)

    other = base.clone()
    other.set_model_patch_replace(foreign, "dit", "double_block", 0)
    x, cond = wan22_call(base, frame_mask=FIRST_CLEAN)
    stock = batch_call(other, x, cond)
    patched = sc.patch(other, budget=None, chunk_tokens=64)   # min_tokens 4096: block 1's 768 rows run stock
    assert rel_err(batch_call(patched, x, cond), stock) <= 1e-5
    assert seen == [("Tensor", (1, 3, 6, DIM))] * 2
    text = sc.report(patched)
    assert "1 call(s) streamed" in text, text
    sections = _block_lines(text)
    assert sc.LEFT_TO_EXISTING in sections["double_block.0"], text
    assert "1 call(s) under min_tokens ran stock" in sections["double_block.1"], text


def test_wan22_timesteps_it_does_not_follow_stay_stock(fresh_captures):
    """Timesteps the streamed forward does not follow run ComfyUI's own forward, the reason in the report: more
    timesteps per entry than latent frames (one per row: the time embedding over every row is stock's; no ComfyUI
    model base gives them), per-frame timesteps of another batch than the latent's: exact; and a table repeat_e
    cannot lay over the rows: the stock forward's own error."""
    import streamplan.integrations.comfy as sc
    base = wan22_patcher(layers=1)
    dm = base.model.diffusion_model
    x = torch.randn(2, CHANNELS, 3, 32, 32)
    context = torch.randn(2, TEXT, 32)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)

    def call(patcher, t):
        options = {**patcher.model_options["transformer_options"], "cond_or_uncond": [0, 1],
                   "sigmas": torch.full((2,), 0.7)}
        with torch.no_grad():
            return dm(x, t, context, transformer_options=options)

    for t, why in ((torch.rand(2, 768) * 1000, "768 timesteps per entry, more than the 3 latent frames"),
                   (torch.tensor([[0.0, 700.0, 700.0]]), "the per-frame timesteps' batch (1) is not the latent's (2)")):
        assert rel_err(call(patched, t), call(base, t)) <= 1e-5
        assert f"1 call(s) stock: {why}" in sc.report(patched), sc.report(patched)

    # 2 timesteps over 3 rows (one row a frame): repeat_e leaves the table as it is and the stock forward raises
    x, t = torch.randn(2, CHANNELS, 3, 2, 2), torch.rand(2, 2) * 1000
    for patcher in (base, patched):
        with pytest.raises(RuntimeError):
            call(patcher, t)
    assert "1 call(s) stock: 2 timesteps over 3 rows: repeat_e leaves such a table as it is" in sc.report(patched)
