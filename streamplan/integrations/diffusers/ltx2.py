"""LTX-2 (diffusers ``LTX2VideoTransformer3DModel``): its model forward with no whole-sequence table beside the video
rows. Per-token timesteps (the image-to-video and conditioned pipelines hand one per video row) make the time
modulation, the audio-video cross-attention modulation and the output head's shift/scale per-row tables, and the
video rotary tables are per row too: stock holds all of them for every row through every block (about 112 KB a row
in bf16 beside a floor of 24). Here the tables are computed once per distinct timestep (a video has a few: the
conditioning frames' and the noisy frames') and each chunk picks its rows; the rotary tables are built a chunk's rows
at a time from the positions (``specs.RowsFrom``); the input projection fills one buffer a chunk at a time, every
block's video input is donated, and the video head runs in row chunks. The audio rows are the small static side and
keep stock's path. The blocks stream from their captured graph."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...execute.chunk_loop import for_chunks
from ...execute.donation import donate
from ...execute.hook_chains import keeps_output, takes_described
from ...execute.row_tables import DistinctRows, described_together
from ...recognize.checks import stock_problem
from ...specs import ModelSpec, RowLoops, RowsFrom, Skip, described_whole
from .models import KNOWN_FORWARDS, call_problem, left_stock, model_call, unknown_forward

_MODULE = "diffusers.models.transformers.transformer_ltx2"
_ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states", "timestep",
         "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask", "audio_encoder_attention_mask",
         "num_frames", "height", "width", "fps", "audio_num_frames", "video_coords", "audio_coords",
         "isolate_modalities", "spatio_temporal_guidance_blocks", "perturbation_mask", "use_cross_timestep",
         "attention_kwargs", "video_self_attention_mask", "video_keyframes_mask", "return_dict")
KNOWN_FORWARDS["LTX2VideoTransformer3DModel"] = {"ef0e1e9103ed6a95": "diffusers 0.42.1"}
_PER_CHUNK = ("proj_in", "norm_out", "proj_out", "rope", "cross_attn_rope", "time_embed",
              "av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate")


def _rotary(rope: nn.Module, coords: torch.Tensor, device: torch.device) -> tuple[RowsFrom, ...]:
    """The rotary (cos, sin) pair of every video row, described: a chunk's pair built from its rows' coordinates
    (the coordinates' rows are dim 2; the tables' dim 1, or 2 for the per-head "split" layout)."""
    dim = 2 if rope.rope_type == "split" else 1
    return described_together(lambda a, b: rope(coords[:, :, a:b], device=device), coords.shape[2], (dim, dim))


def _embedded(module: nn.Module, t: torch.Tensor, rows: DistinctRows | None, batch: int, dtype: torch.dtype,
              scale: float = 1.0):
    """``module(t.flatten() * scale)`` as stock calls it, viewed ``[B, -1, C]``; with ``rows`` (per-row timesteps)
    computed on the distinct values and handed back as per-row descriptions."""
    if rows is None:
        out, emb = module((t.flatten() * scale) if scale != 1.0 else t.flatten(), batch_size=batch, hidden_dtype=dtype)
        return out.view(batch, -1, out.size(-1)), emb.view(batch, -1, emb.size(-1))
    values = rows.values * scale if scale != 1.0 else rows.values
    out, emb = module(values, batch_size=batch, hidden_dtype=dtype)
    return rows.rows_of(out), (rows, emb)


def _proj_in(model, x: torch.Tensor, keyframes, chunk: int) -> torch.Tensor:
    """``proj_in`` (and the keyframe marker's embedding, a per-row add) a chunk of rows at a time into one buffer."""
    out: list[torch.Tensor] = []
    mark = model.config.use_keyframes_abs_pos_embedding and keyframes is not None

    def work(a: int, b: int) -> None:
        y = model.proj_in(x[:, a:b])
        if mark:
            marker = (keyframes[:, a:b] > 0).to(dtype=y.dtype)
            y = y + marker * model.keyframes_abs_pos_embedding.to(dtype=y.dtype)
        if not out:
            out.append(y.new_empty((x.shape[0], x.shape[1], y.shape[-1])))
        out[0][:, a:b] = y

    for_chunks(x.shape[1], chunk, work)
    return out[0]


def _head(model, hidden: torch.Tensor, embedded, chunk: int) -> torch.Tensor:
    """The video output layer (norm, the per-row shift/scale, ``proj_out``) a chunk of rows at a time."""
    out: list[torch.Tensor] = []
    table = model.scale_shift_table

    def work(a: int, b: int) -> None:
        if isinstance(embedded, tuple):   # per-row: this chunk's rows of the distinct timesteps' embeddings
            rows, emb = embedded
            e = rows.pick(emb, a, b)
        else:
            e = embedded if embedded.shape[1] == 1 else embedded[:, a:b]
        values = table[None, None] + e[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        y = model.proj_out(model.norm_out(hidden[:, a:b]) * (1 + scale) + shift)
        if not out:
            out.append(y.new_empty((hidden.shape[0], hidden.shape[1], y.shape[-1])))
        out[0][:, a:b] = y

    for_chunks(hidden.shape[1], chunk, work)
    return out[0]


def _modulation(model, c: dict, timestep: torch.Tensor, hidden_states: torch.Tensor,
                audio_hidden_states: torch.Tensor) -> dict:
    """The blocks' modulation inputs as stock computes them (video ones per row described where the timestep is per
    row), and the heads' embedded timesteps (``embedded``, ``audio_embedded``)."""
    cfg = model.config
    batch_size, rows = hidden_states.shape[0], hidden_states.shape[1]
    audio_timestep = c.get("audio_timestep")
    audio_timestep = audio_timestep if audio_timestep is not None else timestep
    sigma = c.get("sigma")
    audio_sigma = c.get("audio_sigma")
    audio_sigma = audio_sigma if audio_sigma is not None else sigma
    use_cross_timestep = c.get("use_cross_timestep", False)
    gate_factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
    per_row = timestep.ndim == 2 and timestep.shape == (batch_size, rows) and rows > 1
    video_rows = DistinctRows(timestep) if per_row else None
    dtype, audio_dtype = hidden_states.dtype, audio_hidden_states.dtype
    temb, embedded_timestep = _embedded(model.time_embed, timestep, video_rows, batch_size, dtype)
    temb_audio, audio_embedded_timestep = _embedded(model.audio_time_embed, audio_timestep, None, batch_size,
                                                    audio_dtype)
    if model.prompt_modulation and cfg.use_prompt_adaln_single:
        temb_prompt, _ = _embedded(model.prompt_adaln, sigma, None, batch_size, dtype)
        temb_prompt_audio, _ = _embedded(model.audio_prompt_adaln, audio_sigma, None, batch_size, audio_dtype)
    else:
        temb_prompt = temb_prompt_audio = None
    video_ca_timestep = audio_sigma if use_cross_timestep else timestep
    ca_rows = None if use_cross_timestep else video_rows
    video_cross_attn_scale_shift, _ = _embedded(model.av_cross_attn_video_scale_shift, video_ca_timestep, ca_rows,
                                                batch_size, dtype)
    video_cross_attn_a2v_gate, _ = _embedded(model.av_cross_attn_video_a2v_gate, video_ca_timestep, ca_rows,
                                             batch_size, dtype, gate_factor)
    audio_ca_timestep = sigma if use_cross_timestep else audio_timestep
    audio_cross_attn_scale_shift, _ = _embedded(model.av_cross_attn_audio_scale_shift, audio_ca_timestep, None,
                                                batch_size, audio_dtype)
    audio_cross_attn_v2a_gate, _ = _embedded(model.av_cross_attn_audio_v2a_gate, audio_ca_timestep, None,
                                             batch_size, audio_dtype, gate_factor)
    return dict(temb=temb, temb_audio=temb_audio, temb_ca_scale_shift=video_cross_attn_scale_shift,
                temb_ca_audio_scale_shift=audio_cross_attn_scale_shift, temb_ca_gate=video_cross_attn_a2v_gate,
                temb_ca_audio_gate=audio_cross_attn_v2a_gate, temb_prompt=temb_prompt,
                temb_prompt_audio=temb_prompt_audio, embedded=embedded_timestep,
                audio_embedded=audio_embedded_timestep)


def _forward(model, args: tuple, kwargs: dict, chunk: RowLoops):
    """LTX2VideoTransformer3DModel.forward (diffusers 0.42.1), step for step, with the video rows' tables described."""
    mod = sys.modules[_MODULE]
    c = model_call(_ARGS, args, kwargs)
    cfg = model.config
    hidden_states, audio_hidden_states = c["hidden_states"], c["audio_hidden_states"]
    timestep = c["timestep"]
    encoder_attention_mask = c.get("encoder_attention_mask")
    if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
        encoder_attention_mask = ((1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0).unsqueeze(1)
    audio_encoder_attention_mask = c.get("audio_encoder_attention_mask")
    if audio_encoder_attention_mask is not None and audio_encoder_attention_mask.ndim == 2:
        audio_encoder_attention_mask = ((1 - audio_encoder_attention_mask.to(audio_hidden_states.dtype))
                                        * -10000.0).unsqueeze(1)
    video_self_attention_mask = c.get("video_self_attention_mask")
    if video_self_attention_mask is not None:
        video_self_attention_mask = (1 - video_self_attention_mask.to(hidden_states.dtype)) * -10000.0
    batch_size, device = hidden_states.shape[0], hidden_states.device

    # 1. rotary tables: the video rows' described, the audio rows' whole
    video_coords, audio_coords = c.get("video_coords"), c.get("audio_coords")
    if video_coords is None:
        video_coords = model.rope.prepare_video_coords(batch_size, c.get("num_frames"), c.get("height"),
                                                       c.get("width"), device, fps=c.get("fps", 24.0))
    if audio_coords is None:
        audio_coords = model.audio_rope.prepare_audio_coords(batch_size, c.get("audio_num_frames"),
                                                             audio_hidden_states.device)
    video_rotary_emb = _rotary(model.rope, video_coords, device)
    audio_rotary_emb = model.audio_rope(audio_coords, device=audio_hidden_states.device)
    video_cross_attn_rotary_emb = _rotary(model.cross_attn_rope, video_coords[:, 0:1, :], device)
    audio_cross_attn_rotary_emb = model.cross_attn_audio_rope(audio_coords[:, 0:1, :],
                                                              device=audio_hidden_states.device)

    # 2. input projections (the video rows a chunk at a time)
    hidden_states = _proj_in(model, hidden_states, c.get("video_keyframes_mask"), chunk())
    audio_hidden_states = model.audio_proj_in(audio_hidden_states)

    # 3. timestep embeddings and modulation: per-row ones from the distinct timesteps
    m = _modulation(model, c, timestep, hidden_states, audio_hidden_states)
    embedded_timestep, audio_embedded_timestep = m.pop("embedded"), m.pop("audio_embedded")

    # 4. prompt embeddings
    encoder_hidden_states, audio_encoder_hidden_states = c["encoder_hidden_states"], c["audio_encoder_hidden_states"]
    if cfg.use_prompt_embeddings:
        encoder_hidden_states = model.caption_projection(encoder_hidden_states).view(
            batch_size, -1, hidden_states.size(-1))
        audio_encoder_hidden_states = model.audio_caption_projection(audio_encoder_hidden_states).view(
            batch_size, -1, audio_hidden_states.size(-1))

    # 5. the blocks, each video input donated
    stg_blocks = set(c.get("spatio_temporal_guidance_blocks") or [])
    perturbation_mask = c.get("perturbation_mask")
    if stg_blocks and perturbation_mask is None:
        perturbation_mask = torch.zeros((batch_size,))
    if perturbation_mask is not None and perturbation_mask.ndim == 1:
        perturbation_mask = perturbation_mask[:, None, None]
    # a Python bool where stock passes a 0-d tensor (one read of a [batch] mask per call): the processor only branches
    # on it, and a capture keys on a bool where the tensor's branch would be data-dependent (the block left stock)
    all_perturbed = bool(torch.all(perturbation_mask == 0)) if perturbation_mask is not None else False
    isolate = c.get("isolate_modalities", False)
    kept = None
    for block_idx, block in enumerate(model.transformer_blocks):
        kw = dict(hidden_states=hidden_states, audio_hidden_states=audio_hidden_states,
                  encoder_hidden_states=encoder_hidden_states, audio_encoder_hidden_states=audio_encoder_hidden_states,
                  **m, video_rotary_emb=video_rotary_emb,
                  audio_rotary_emb=audio_rotary_emb, ca_video_rotary_emb=video_cross_attn_rotary_emb,
                  ca_audio_rotary_emb=audio_cross_attn_rotary_emb, encoder_attention_mask=encoder_attention_mask,
                  audio_encoder_attention_mask=audio_encoder_attention_mask,
                  self_attention_mask=video_self_attention_mask, audio_self_attention_mask=None,
                  a2v_cross_attention_mask=None, v2a_cross_attention_mask=None, use_a2v_cross_attention=not isolate,
                  use_v2a_cross_attention=not isolate,
                  perturbation_mask=perturbation_mask if block_idx in stg_blocks else None,
                  all_perturbed=all_perturbed if block_idx in stg_blocks else False)
        if not takes_described(block):   # a block streamplan does not stream: its tables whole, as stock's
            _, kw = described_whole((), kw)
        with donate(*(() if kept else (hidden_states,))):
            hidden_states, audio_hidden_states = block(**kw)
        del kw
        kept = keeps_output(block)

    # 6. output layers: the video rows a chunk at a time
    output = _head(model, hidden_states, embedded_timestep, chunk())
    del hidden_states
    audio_values = model.audio_scale_shift_table[None, None] + audio_embedded_timestep[:, :, None]
    audio_shift, audio_scale = audio_values[:, :, 0], audio_values[:, :, 1]
    audio_hidden_states = model.audio_norm_out(audio_hidden_states)
    audio_output = model.audio_proj_out(audio_hidden_states * (1 + audio_scale) + audio_shift)
    if not c.get("return_dict", True):
        return (output, audio_output)
    return mod.AudioVisualModelOutput(sample=output, audio_sample=audio_output)


def _can_stream(model, args: tuple, kwargs: dict) -> str | None:
    c = model_call(_ARGS, args, kwargs)
    problem = call_problem(model, c)
    if problem:
        return problem
    x = c.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, video rows, channels]"
    for name in ("audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states", "timestep"):
        if not isinstance(c.get(name), torch.Tensor):
            return f"{name} is not a tensor"
    if c.get("video_coords") is None and None in (c.get("num_frames"), c.get("height"), c.get("width")):
        return "neither video_coords nor num_frames, height and width are given"
    return None


def recognize_ltx2_model(name: str, module: nn.Module) -> ModelSpec | Skip | None:
    mod = sys.modules.get(_MODULE)
    if mod is None or not isinstance(module, mod.LTX2VideoTransformer3DModel):
        return None
    skip = lambda why: left_stock(name, module, why)  # noqa: E731
    unknown = unknown_forward(name, module, mod.LTX2VideoTransformer3DModel)
    if unknown:
        return unknown
    for sub in _PER_CHUNK:
        # called once per row chunk (the ropes and the per-row embeddings per chunk or per distinct timestep): only
        # weight hooks on them (a cache hook would count chunks as steps)
        problem = stock_problem(getattr(module, sub), onloads=True, per_chunk=True)
        if problem:
            return skip(f"{sub}: {problem}")
    return ModelSpec(module, "diffusers.LTX2VideoTransformer3DModel[per-row tables described, donated blocks, "
                             "streamed head]",
                     run=lambda args, kwargs, chunk: _forward(module, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _can_stream(module, args, kwargs))
