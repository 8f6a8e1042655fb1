"""streamplan.integrations.comfy's streamed forward of ComfyUI 0.33.0's LTX-2 (``LTXAVModel``,
``streamplan/integrations/comfy/forwards_ltxav.py``): a tiny random-weight model in a real ``LTXAV`` ``BaseModel`` and
``ModelPatcher``, called as ComfyUI's samplers call it (``apply_model`` on the packed [video, audio] latent with
``latent_shapes``), with the per-token video timesteps LTX-2's image-to-video gives (the sampler's noise mask: the
first latent frame clean), against the model's own stock forward."""
from __future__ import annotations

import copy

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import CPU, batch_call, _block_lines, _config, _conds, _forwards_installed, _random_, \
    fresh_captures, sample_call

__all__ = ["fresh_captures"]   # the fixture, used by name

# widths: video 64 (4 heads of 16), audio 32 (4 heads of 8); row counts kept off every width and its multiples the
# block builds (a capture reads a size equal to the row count as rows)
VIDEO, AUDIO, HW, AUDIO_FRAMES, TEXT = 64, 32, 16, 20, 7


def ltxav_patcher(layers: int = 2, **config):
    comfy = comfyui()
    unet = {"image_model": "ltxav", "in_channels": 8, "audio_in_channels": 128, "cross_attention_dim": VIDEO,
            "audio_cross_attention_dim": AUDIO, "attention_head_dim": 16, "num_attention_heads": 4,
            "audio_attention_head_dim": 8, "audio_num_attention_heads": 4, "caption_channels": 32,
            "num_layers": layers, "connector_attention_head_dim": 8, "connector_num_attention_heads": 4,
            "connector_num_layers": 1, **config}
    base = comfy.model_base.LTXAV(_config(comfy, unet, comfy.latent_formats.LTXAV))
    _random_(base)
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)


def ltxav_call(patcher, frames: int = 4, per_token: bool = True, seed: int = 0, frame_mask=None, **extra):
    """(x, cond) as ComfyUI's sampler hands them: the packed [video, audio] latent (``frames`` x 16 x 16 video rows,
    20 audio rows) and the model's own ``extra_conds``; with ``per_token`` the sampler's packed noise mask of
    LTX-2's image-to-video (LTXVImgToVideo's first latent frame at 0, or ``frame_mask`` ``[batch, frames]``, then
    LTXVConcatAVLatent's), from which ``LTXAV.process_timestep`` makes one video timestep per row."""
    comfy = comfyui()
    g = torch.Generator().manual_seed(seed)
    batch = 1 if frame_mask is None else frame_mask.shape[0]
    video = torch.randn(batch, 8, frames, HW, HW, generator=g)
    audio = torch.randn(batch, 8, AUDIO_FRAMES, 16, generator=g)
    x, shapes = comfy.utils.pack_latents([video, audio])
    kw = dict(cross_attn=torch.randn(batch, TEXT, 64, generator=g), latent_shapes=shapes, **extra)
    if per_token:
        if frame_mask is None:
            frame_mask = torch.ones(1, frames)
            frame_mask[:, :1] = 0.0
        mask = frame_mask[:, None, :, None, None].expand(video.shape)
        kw["denoise_mask"], _ = comfy.utils.pack_latents([mask, torch.ones(audio.shape)])
    return x, _conds(patcher.model, **kw)


def _per_token(patcher, x, cond) -> bool:
    """Whether the model's video timestep is one per row (as the model forward receives it)."""
    t = patcher.model.process_timestep(torch.tensor([0.7]), x=x, **{k: v for k, v in cond.items()
                                                                      if k != "latent_shapes"})[0]
    return t.numel() == cond["latent_shapes"][0][2:].numel() and t.unique().numel() == 2


def _streamed_fully(text: str, blocks: int) -> None:
    assert "1 call(s) streamed (input projection and output head in 64-row chunks, " \
           f"{blocks} block input(s) donated in the last)" in text, text
    assert text.count("1 call(s) through the streamer") == blocks, text
    assert "ran stock" not in text and "built whole" not in text, text


@pytest.mark.parametrize("case", ["image-to-video", "text-to-video", "reference audio", "LTX-2.3 layout, batch 2"])
def test_ltxav_streams_exactly(fresh_captures, case):
    """The whole apply_model call through patch(): the video tables from the distinct timesteps (a per-token
    timestep's two values here, one without the mask), the rotary tables a chunk's rows at a time, every block's video
    input donated and every block streamed from its captured graph (audio rows its static side), the video head on
    row chunks: video and audio outputs within fp32 rel 1e-5 of ComfyUI's own forward; the base patcher and the
    shared model as they were. Also with ID-LoRA's reference audio tokens before the audio rows, and in LTX-2.3's
    layout (cross-attention AdaLN with its prompt timestep, gated attention) on a cond + uncond batch whose entries'
    timesteps differ (the second's largest is not the first's: its prompt timestep takes its own)."""
    import streamplan.integrations.comfy as sc
    per_token = case != "text-to-video"
    config, extra, frame_mask = {}, {}, None
    if case == "reference audio":
        extra["ref_audio"] = {"tokens": torch.randn(1, 6, 128)}
    if case.startswith("LTX-2.3"):
        config = {"cross_attention_adaln": True, "apply_gated_attention": True}
        frame_mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.5, 0.5, 0.5]])
    base = ltxav_patcher(**config)
    x, cond = ltxav_call(base, per_token=per_token, frame_mask=frame_mask, **extra)
    if frame_mask is None:
        assert _per_token(base, x, cond) == per_token
    before = copy.copy(base.model_options["transformer_options"])
    stock = batch_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out = batch_call(patched, x, cond)
    video = cond["latent_shapes"][0][1:].numel()
    assert rel_err(out[..., :video], stock[..., :video]) <= 1e-5
    assert rel_err(out[..., video:], stock[..., video:]) <= 1e-5
    _streamed_fully(sc.report(patched), 2)
    assert base.model_options["transformer_options"] == before
    assert _forwards_installed(base.model) == []


def test_ltxav_tables_are_never_whole(fresh_captures):
    """The peak grows with the video rows under LTX-2's per-token timesteps as it does under one timestep for every
    row, and near the blocks' floor: no per-row table is ever whole. Stock holds the two rotary pairs for every row
    (192 values a row at these widths) and builds the audio-video cross-attention modulation for every row (320
    values) before compressing it per frame; the floor is the residual, the self-attention's K and V and the
    video-to-audio attention's K and V (256 values a row). Measured at 256-row chunks, 2048 -> 3072 video rows: the
    streamed peak grows 1.08x the floor's growth per-token, 1.04x under one timestep; stock's 4.1x and 3.5x (3072
    rows per-token: stock 12.30 MiB, streamed 4.90 MiB)."""
    import streamplan.integrations.comfy as sc
    base = ltxav_patcher()
    patched = sc.patch(base, budget=None, chunk_tokens=256, min_tokens=0)
    floor_row = (3 * VIDEO + 2 * AUDIO) * 4                     # bytes a video row holds at the blocks' floor, fp32
    growth, stock_growth, lines = {}, {}, []
    for per_token in (True, False):
        peaks, stock_peaks = [], []
        for frames in (8, 12):
            x, cond = ltxav_call(base, frames=frames, per_token=per_token, seed=frames)
            stock, stock_peak = streamplan.measure_peak(sample_call, base, x, cond)
            out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
            assert rel_err(out, stock) <= 1e-5
            peaks.append(peak)
            stock_peaks.append(stock_peak)
            lines.append(f"{'per-token' if per_token else 'scalar'} {frames * HW * HW} rows: stock "
                         f"{stock_peak / 2**20:.2f} MiB, streamed {peak / 2**20:.2f} MiB")
        rows = 4 * HW * HW
        growth[per_token] = (peaks[1] - peaks[0]) / rows
        stock_growth[per_token] = (stock_peaks[1] - stock_peaks[0]) / rows
    print("\n".join(lines), {k: round(v / floor_row, 2) for k, v in growth.items()},
          {k: round(v / floor_row, 2) for k, v in stock_growth.items()})
    # a whole table of one hidden width (the a2v gate: 64 fp32 values) is 256 bytes a row; the sampler's own per-row
    # timestep inputs (the mask times sigma, patchified) and the row index are under 64
    assert growth[True] - growth[False] <= 96, growth
    # the rotary pairs whole would add 0.75 of the floor a row
    assert growth[True] <= 1.25 * floor_row and growth[False] <= 1.25 * floor_row, (growth, floor_row)
    assert stock_growth[True] >= 3 * growth[True], (stock_growth, growth)
    text = sc.report(patched)
    assert "4 call(s) streamed" in text and "ran stock" not in text and "built whole" not in text, text


def test_ltxav_blocks_take_whole_tables_where_they_run_stock(fresh_captures):
    """Where a block runs stock under the streamed forward (a call under min_tokens, another node's replacement) it
    gets the tables whole, as the stock forward hands them: exact, the forward still streamed."""
    import streamplan.integrations.comfy as sc
    base = ltxav_patcher()
    seen = []

    def foreign(args, extra):
        seen.append(type(args["v_pe"][0]).__name__)
        return extra["original_block"](args)

    other = base.clone()
    other.set_model_patch_replace(foreign, "dit", "double_block", 0)
    x, cond = ltxav_call(base)
    stock = sample_call(other, x, cond)
    patched = sc.patch(other, budget=None, chunk_tokens=64)   # min_tokens 4096: block 1's 1024 rows run stock
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    assert seen == ["Tensor", "Tensor"]
    text = sc.report(patched)
    assert "1 call(s) streamed" in text, text
    sections = _block_lines(text)
    assert sc.LEFT_TO_EXISTING in sections["double_block.0"], text
    assert "1 call(s) under min_tokens ran stock" in sections["double_block.1"], text


def test_ltxav_unsupported_calls_stay_stock(fresh_captures, monkeypatch):
    """What the streamed forward does not follow runs ComfyUI's own forward, the reason in the report: keyframe
    (guide) conditioning, an STG pass (its perturbed blocks read a transformer_options switch), and a forward whose
    source is not 0.33.0's. Under the stock forward the blocks still stream (its per-frame timestep tables described
    a chunk's rows at a time) where nothing they read changes their math; the STG pass keeps them stock, naming the
    switch."""
    comfy = comfyui()
    import comfy.ldm.lightricks.av_model as av
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

    import streamplan.integrations.comfy as sc
    base = ltxav_patcher()
    dm = base.model.diffusion_model

    # a guide frame appended after 4 latent frames (LTXVAddGuide's layout): its 256 rows' pixel coordinates
    guide = latent_to_pixel_coords(dm.patchifier.get_latent_coords(1, HW, HW, 1, CPU), dm.vae_scale_factors)
    x, cond = ltxav_call(base, frames=5, keyframe_idxs=guide)
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert "model forward (LTXAVModel): 1 call(s) stock: keyframe_idxs are given" in text, text
    assert text.count("1 call(s) through the streamer") == 2 and "ran stock" not in text, text

    x, cond = ltxav_call(base)
    stg = base.clone()
    stg.model_options["transformer_options"]["stg_self_attn_blocks"] = frozenset({1})
    stock = sample_call(stg, x, cond)
    assert rel_err(stock, sample_call(base, x, cond)) > 1e-3          # the perturbed pass differs
    patched = sc.patch(stg, budget=None, chunk_tokens=64, min_tokens=0)
    assert torch.equal(sample_call(patched, x, cond), stock)
    text = sc.report(patched)
    assert "1 call(s) stock: transformer_options set stg_self_attn_blocks" in text, text
    assert text.count("transformer_options key(s) streamplan does not know: stg_self_attn_blocks") == 2, text

    stock_helper = av.LTXAVModel._prepare_timestep

    def _prepare_timestep(self, *args, **kwargs):
        return stock_helper(self, *args, **kwargs)

    monkeypatch.setattr(av.LTXAVModel, "_prepare_timestep", _prepare_timestep)
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert ("1 call(s) stock: LTXAVModel._prepare_timestep is not the code streamplan follows (ComfyUI 0.33.0's): "
            "unknown forward") in text, text
    assert text.count("1 call(s) through the streamer") == 2 and "ran stock" not in text, text
    assert comfy is not None
