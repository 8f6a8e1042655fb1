"""The streamed forward of ComfyUI's LTX-2 (``comfy.ldm.lightricks.av_model.LTXAVModel``, model_base ``LTXAV``, 0.33.0).

Stock builds, before its blocks, per-video-row tables: under per-token timesteps (image-to-video's clean first frame,
a ``denoise_mask``) the audio-video cross-attention scale/shift (4 x hidden) and gate are computed for every video row
before being compressed per frame, and the two rotary pairs (self-attention's, and the audio-video cross-attention's)
are held for every row through every block; the head expands its embedded timestep to every row. Streamed:

- the model's own helpers prepare the rows, context, masks and the audio side as stock does; its ``_prepare_timestep``
  is handed the distinct video timesteps instead of one per row (a video has a few), so every video table is computed
  once per distinct value and each block chunk picks its rows (``specs.RowsFrom``, as ``execute.row_tables``);
- the video rotary tables are built a chunk's rows at a time by the model's own ``_prepare_positional_embeddings``
  (``row_tables.described_together``); the audio rows are the small static side and get stock's tables whole;
- each block's video input is donated to streamplan's block replacement; the video head runs on row chunks into its
  small output.

A call this forward does not follow keeps the stock forward, the reason in the report: keyframe (guide) conditioning,
and the transformer_options ComfyUI's LTX-2 guidance passes set for the blocks to read (STG's perturbed blocks,
modality guidance's severed audio-video cross-attention, the video- or audio-only switches)."""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ...execute.chunk_loop import chunk_bounds
from ...execute.row_tables import DistinctRows, described_together
from ...specs import RowsFrom, described_whole
from .forward_loops import block_call, chunk_rows, row_loop

# transformer_options the model forward or its blocks read to change a call's math (ComfyUI 0.33.0)
_BLOCK_OPTIONS = ("stg_self_attn_blocks", "stg_skip_self_attn", "run_vx", "run_ax", "a2v_cross_attn",
                  "v2a_cross_attn")
# the key under which a rehearsal's call carries the video rows' distinct timesteps, read before it
# (``rehearsal_inputs``)
_DISTINCT = "streamplan_distinct_timesteps"
# the keyword arguments of BasicAVTransformerBlock.forward besides x, as the stock forward's args dict names them
_BLOCK_KWARGS = ("v_context", "a_context", "attention_mask", "v_timestep", "a_timestep", "v_pe", "a_pe", "v_cross_pe",
                 "a_cross_pe", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
                 "v_cross_gate_timestep", "a_cross_gate_timestep", "transformer_options", "self_attention_mask",
                 "v_prompt_timestep", "a_prompt_timestep")


def _block_wrap(block):
    """The "original_block" the block replacement gets (a closure over the block module alone, as stock's). The
    block module takes the tables whole; streamplan's streamed call, swapped into the closure by the replacement,
    takes them described (a chunk's rows built when it reads them)."""
    def block_wrap(args):
        kwargs = {k: args.get(k) for k in _BLOCK_KWARGS}
        if isinstance(block, nn.Module):
            _, kwargs = described_whole((), kwargs)
        return {"img": block(args["img"], **kwargs)}
    return block_wrap


# --- the block (comfy.ldm.lightricks.av_model.BasicAVTransformerBlock) as its streamer takes it ---------------------

BLOCK_PATH = "comfy.ldm.lightricks.av_model.BasicAVTransformerBlock"


class _OutOfPlace(TorchFunctionMode):
    """While the block is traced: each in-place op on one of ``tracked`` computed out of place, that tensor standing
    for its latest value in every later op (its own storage never read again). The audio rows are the block's
    static side; a graph streamed in row chunks computes a static value once per call, and an in-place update of
    it from every video row (the video-to-audio attention's) would then run once per chunk, into the same tensor."""

    def __init__(self, *tracked: torch.Tensor):
        super().__init__()
        self.kept = tracked                                  # alive while the mode is: their ids are not reused
        self.latest = {id(t): t for t in tracked}

    def value(self, t: torch.Tensor) -> torch.Tensor:
        return self.latest.get(id(t), t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def current(v):
            return self.latest.get(id(v), v) if isinstance(v, torch.Tensor) else v
        a, k = pytree.tree_map(current, args), pytree.tree_map(current, kwargs or {})
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.latest and name.endswith("_") \
                and not name.startswith("_"):
            self.latest[id(args[0])] = getattr(torch.Tensor, name[:-1])(*a, **k)
            return args[0]
        return func(*a, **k)


class CopiedInputs(nn.Module):
    """ComfyUI's LTX-2 block as the capture sees it. The block updates its video and audio rows in place: its video
    rows' self-attention update lands before its video-to-audio attention reads them over every row (in a graph
    streamed in phases, a write into the input would run in both), and its audio rows take the video-to-audio
    attention's update. Captured, the block is handed a copy of the video rows (each chunk's rows copied as it
    computes them, then updated in place) and its audio updates are traced out of place (``_OutOfPlace``); run
    stock, it gets the host's own tensors and transformer_options (``host``, set per call), as the host calls it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.training = False          # the block's own flag is checked by the caller; never flipped here
        self.host: dict | None = None

    def forward(self, x, **kwargs):
        if not torch.compiler.is_exporting():
            if self.host is not None:
                kwargs = {**kwargs, "transformer_options": self.host}
            return self.block(x, **kwargs)
        vx, ax = x
        with _OutOfPlace(ax) as audio:
            vx, ax = self.block((vx.clone(), ax), **kwargs)
            return vx, audio.value(ax)


def _frames_as_rows(t: Any) -> Any:
    """A ``CompressedTimestep`` as a tensor the capture can take: its data where it has one row per row or one for
    all (the block's tensor path is the same sum), else (one row per frame) described: a chunk's rows picked from
    their frames'. Anything else as it is."""
    from comfy.ldm.lightricks.av_model import CompressedTimestep
    if not isinstance(t, CompressedTimestep):
        return t
    if t.patches_per_frame == 1:
        return t.data
    data, per_frame = t.data, t.patches_per_frame
    return RowsFrom(lambda a, b: data[:, torch.arange(a, b, device=data.device) // per_frame],
                    torch.Size((t.batch_size, t.num_frames * per_frame, t.feature_dim)), data.dtype, data.device)


def streamed_call(streamer, adapter: CopiedInputs, args: tuple, kwargs: dict) -> Any:
    """One host call of the block through ``streamer`` (a ``BlockStreamer`` over ``adapter``): the stock forward's
    compressed per-frame tables described, the host's transformer_options kept for a stock run (the caller checked
    that nothing in them changes the block's math: the capture and the streamed run get an empty one)."""
    kwargs = {k: _frames_as_rows(v) for k, v in kwargs.items()}
    adapter.host = kwargs.get("transformer_options") or {}
    try:
        return streamer(*args, **{**kwargs, "transformer_options": {}})
    finally:
        adapter.host = None


# --- the model forward -----------------------------------------------------------------------------------------------

class _Picks:
    """The video rows' timesteps as ``DistinctRows`` (their distinct values, each row's index among them), for tables
    with a row per batch entry and distinct value: ``[B, U, C]`` stands for the per-row ``[B, N, C]`` stock builds."""

    def __init__(self, rows: DistinctRows):
        self.index, self.distinct = rows.index, rows.values.numel()
        self.batch = torch.arange(rows.batch, device=rows.index.device)[:, None]

    def rows_of(self, table: torch.Tensor) -> RowsFrom:
        b, n = self.index.shape
        return RowsFrom(lambda s, e: self.pick(table, s, e), torch.Size((b, n, *table.shape[2:])), table.dtype,
                        table.device)

    def pick(self, table: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return table[self.batch, self.index[:, a:b]]


def _timesteps(model, timestep: torch.Tensor, batch: int, dtype: torch.dtype, merged: dict, rows: int,
               known: DistinctRows | None = None):
    """``model._prepare_timestep``'s three outputs, with per-row video timesteps handed to it as their distinct values
    (``[B, U]``: each batch entry's own values, a value it lacks standing in as its largest, so the per-entry and
    overall maxima its prompt and gate timesteps take are stock's); and the ``_Picks`` of the video rows, or None
    where the timestep is one per batch entry (its tables have one row). ``known``: the rows' distinct values read
    from the real timestep before a rehearsal (whose fake timestep has none), so its tables are the real call's."""
    if timestep.dim() < 2 or timestep.numel() // batch != rows or rows < 2:
        return (*model._prepare_timestep(timestep, batch, dtype, **merged), None)
    flat = timestep.reshape(batch, rows)
    if known is not None and (known.batch, known.rows) == (batch, rows):
        distinct = copy.copy(known)
        distinct.index = known.index.clone()   # held over the forward as the real call's: counted in the rehearsal
    else:
        distinct = DistinctRows(flat)
    present = torch.zeros(batch, distinct.values.numel(), dtype=torch.bool, device=flat.device)
    present.scatter_(1, distinct.index, True)
    values = torch.where(present, distinct.values[None], flat.max(dim=1, keepdim=True).values)
    values = values.reshape(batch, distinct.values.numel(), *timestep.shape[2:])
    # has_spatial_mask: the helper's per-token layout (no per-frame compression), one table row per distinct value
    return (*model._prepare_timestep(values, batch, dtype, **{**merged, "has_spatial_mask": True}), _Picks(distinct))


def _video_table(t: Any, picks: _Picks | None) -> Any:
    """A video table as the block reads it: a ``CompressedTimestep`` with a row per distinct timestep described per
    row (``picks``), else as ``_frames_as_rows`` gives it (one row for all as its tensor: the block's tensor path is
    the same sum as its compressed one)."""
    from comfy.ldm.lightricks.av_model import CompressedTimestep
    if isinstance(t, CompressedTimestep) and t.patches_per_frame == 1 and picks is not None \
            and t.data.shape[1] == picks.distinct > 1:
        return picks.rows_of(t.data)
    return _frames_as_rows(t)


class LTXAV:
    """``LTXAVModel._forward`` streamed: ``problem`` says why a call keeps the stock forward, ``forward`` runs it."""

    plans_ahead = True   # rehearsed whole under a size budget (``forward_budget``)

    @staticmethod
    def rehearsal_inputs(model: Any, call: dict) -> dict:
        """What the rehearsal (fake tensors, no values) gets beside or in place of the call's arguments whose values
        the forward decides on, read from the real call before it. The sampler's denoise mask, which
        ``_process_input`` reads (whether a frame's rows differ: ``has_spatial_mask``, the video tables' layout) and
        nothing else reads where ``problem`` passed the call (no keyframes): its stand-in holds each frame's min and
        max of the entry and channel that check reads, ``[1, 1, frames, 1, 2]``, so the model's own check decides on
        it as on the whole mask. A per-row video timestep's distinct values (``_DISTINCT``): how many rows its video
        tables have, so the rehearsal's blocks get the tables (and plan under the signatures) the real call's do."""
        stand_ins = {}
        mask, t, batch = call.get("denoise_mask"), call["timestep"], call["x"][0].shape[0]
        if isinstance(mask, torch.Tensor) and mask.dim() == 5:
            frames = mask[:1, :1].flatten(3)
            stand_ins["denoise_mask"] = torch.stack((frames.amin(-1), frames.amax(-1)), -1)[..., None, :]
        if t.dim() >= 2 and t.numel() // batch >= 2:
            stand_ins[_DISTINCT] = DistinctRows(t.reshape(batch, -1))
        return stand_ins

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x, keyframes = call.get("x"), call.get("keyframe_idxs")
        if (not isinstance(x, (list, tuple)) or len(x) != 2 or not all(isinstance(v, torch.Tensor) for v in x)
                or x[0].dim() != 5 or x[1].dim() != 4):
            return "x is not the [video, audio] latent pair"
        if keyframes is not None and keyframes.shape[2] > 0:
            return "keyframe_idxs are given (guide rows are filtered and the head's rows scattered back)"
        options = call.get("transformer_options") or {}
        read = [k for k in _BLOCK_OPTIONS if k in options]
        if read:
            return (f"transformer_options set {', '.join(read)} (a guidance pass's switch the blocks read: "
                    "STG's perturbed self-attention, modality guidance, a video- or audio-only pass)")
        t = call.get("timestep")
        if not isinstance(t, torch.Tensor):
            return "the video timestep is not a tensor"
        batch = x[0].shape[0]
        rows = x[0].shape[2] * x[0].shape[3] * x[0].shape[4]
        if t.dim() > 1 and t.numel() // batch not in (1, rows):
            return f"the video timestep has {t.numel() // batch} values per entry, neither 1 nor one per row"
        return None

    @staticmethod
    def forward(model: Any, call: dict, state: Any) -> Any:
        import comfy.model_prefetch as prefetch

        x, timestep, context, attention_mask = call["x"], call["timestep"], call["context"], call["attention_mask"]
        frame_rate, options = call.get("frame_rate", 25), call.get("transformer_options", {})
        keyframe_idxs, denoise_mask = call.get("keyframe_idxs"), call.get("denoise_mask")
        input_dtype, batch = x[0].dtype, x[0].shape[0]
        merged = {**options, **(call.get("kwargs") or {})}
        x, coords, extra = model._process_input(x, keyframe_idxs, denoise_mask, **merged)
        merged.update(extra)
        vx, ax = x
        rows = vx.shape[1]

        out, embedded, prompt_timestep, picks = _timesteps(model, timestep, batch, input_dtype, merged, rows,
                                                           call.get(_DISTINCT))
        merged["prompt_timestep"] = prompt_timestep
        v_timestep, a_timestep, cross, v_prompt_timestep, a_prompt_timestep = out
        a_cross_ss, v_cross_ss, v_cross_gate, a_cross_gate = cross
        v_timestep, v_cross_ss, v_cross_gate = (_video_table(t, picks) for t in (v_timestep, v_cross_ss, v_cross_gate))
        v_embedded, a_embedded = embedded
        context, attention_mask = model._prepare_context(context, batch, x, attention_mask)
        attention_mask = model._prepare_attention_mask(attention_mask, input_dtype)
        v_context, a_context = context

        # rotary tables: the audio rows' whole (with the split flags) from one call on a single video row; the video
        # rows' built a chunk's rows at a time by the same function (each call's audio side one row, unused)
        v_coords, a_coords = coords
        (v_probe, vc_probe), (a_pe, a_cross_pe) = model._prepare_positional_embeddings(
            [v_coords[:, :, :1].clone(), a_coords], frame_rate, input_dtype)

        def video_rope(a: int, b: int):
            (v, vc), _ = model._prepare_positional_embeddings([v_coords[:, :, a:b].clone(), a_coords[:, :, :1]],
                                                              frame_rate, input_dtype)
            return v[0], vc[0]
        v_rows, vc_rows = described_together(video_rope, rows, (1, 1))
        v_pe, v_cross_pe = (v_rows, v_probe[1]), (vc_rows, vc_probe[1])
        del v_probe, vc_probe, coords
        self_attention_mask = model._build_guide_self_attention_mask(x, options, merged)
        del x

        blocks_replace = options.get("patches_replace", {}).get("dit", {})
        queue = prefetch.make_prefetch_queue(list(model.transformer_blocks), vx.device, options)
        donated = 0
        for i, block in enumerate(model.transformer_blocks):
            prefetch.prefetch_queue_pop(queue, vx.device, block)
            args = {"img": (vx, ax), "v_context": v_context, "a_context": a_context, "attention_mask": attention_mask,
                    "v_timestep": v_timestep, "a_timestep": a_timestep, "v_pe": v_pe, "a_pe": a_pe,
                    "v_cross_pe": v_cross_pe, "a_cross_pe": a_cross_pe, "v_cross_scale_shift_timestep": v_cross_ss,
                    "a_cross_scale_shift_timestep": a_cross_ss, "v_cross_gate_timestep": v_cross_gate,
                    "a_cross_gate_timestep": a_cross_gate, "transformer_options": options,
                    "self_attention_mask": self_attention_mask, "v_prompt_timestep": v_prompt_timestep,
                    "a_prompt_timestep": a_prompt_timestep}
            key = ("double_block", i)
            replacement = blocks_replace.get(key)
            if getattr(replacement, "streamplan_donates", False):
                (vx, ax), gave = block_call(blocks_replace, key, vx, args, _block_wrap(block))
                donated += gave
            else:   # a foreign replacement, or none: the tables whole, as the stock forward hands them
                _, args = described_whole((), args)
                if replacement is not None:
                    vx, ax = replacement(args, {"original_block": _block_wrap(block)})["img"]
                else:
                    vx, ax = _block_wrap(block)(args)["img"]
            del args
        prefetch.prefetch_queue_pop(queue, vx.device, None)
        state.forward.donated_blocks = donated
        del v_pe, v_cross_pe, v_rows, vc_rows, v_timestep, v_cross_ss, v_cross_gate

        # the video head: norm, scale-shift and projection on row chunks into its (small) output
        chunk = chunk_rows(state, vx.device, model.inner_dim * 6)
        table = model.scale_shift_table[None, None].to(device=vx.device, dtype=vx.dtype)
        v_embedded = _video_table(v_embedded, picks)
        video = None
        with row_loop(state, model.norm_out, model.proj_out):   # their weights cast once, not per chunk
            for a, b in chunk_bounds(rows, chunk):
                e = v_embedded.make(a, b) if isinstance(v_embedded, RowsFrom) else (
                    v_embedded if v_embedded.shape[1] == 1 else v_embedded[:, a:b])
                values = table + e[:, :, None]
                shift, scale = values[:, :, 0], values[:, :, 1]
                y = model.proj_out(model.norm_out(vx[:, a:b]) * (1 + scale) + shift)
                if video is None:
                    video = y.new_empty(batch, rows, y.shape[-1])
                video[:, a:b] = y
                del e, values, shift, scale, y
        del vx
        orig_shape = merged["orig_shape"]
        video = model.patchifier.unpatchify(latents=video, output_height=orig_shape[3], output_width=orig_shape[4],
                                            output_num_frames=orig_shape[2],
                                            out_channels=orig_shape[1] // math.prod(model.patchifier.patch_size))

        # the audio head, whole (the small side), as LTXAVModel._process_output
        ref_audio_seq_len = merged.get("ref_audio_seq_len", 0)
        if ref_audio_seq_len > 0:
            ax = ax[:, ref_audio_seq_len:]
            if a_embedded.shape[1] > 1:
                a_embedded = a_embedded[:, ref_audio_seq_len:]
        values = (model.audio_scale_shift_table[None, None].to(device=a_embedded.device, dtype=a_embedded.dtype)
                  + a_embedded[:, :, None])
        a_shift, a_scale = values[:, :, 0], values[:, :, 1]
        ax = model.audio_proj_out(model.audio_norm_out(ax) * (1 + a_scale) + a_shift)
        ax = model.a_patchifier.unpatchify(ax, channels=model.num_audio_channels, freq=model.audio_frequency_bins)
        return model.recombine_audio_and_video_latents(video, ax, merged.get("av_orig_shape"))
