"""The ``DIFFUSION_MODEL`` wrapper ``patch`` installs (ComfyUI's ``patcher_extension``): what a block replacement cannot
see. Each model call goes through it, so it keeps the per-call facts (the run a call belongs to, which resets the
blocks' plans; the memory room under the budget) and, for the models whose forward streamplan follows (ComfyUI 0.33.0's
MiniMax-H3 and Wan here, Flux and HunyuanVideo in ``forwards_joint``, LTX-Video in ``forwards_ltxv``, LTX-2 in
``forwards_ltxav``; each registered with ``register_forward``, gated by ``models``), runs the forward streamed:

- the input projection (Wan's patch embedding, H3's video and audio patch projections, both fp32) runs on row chunks
  written into one hidden-state buffer of the model's dtype, so no fp32 ``[rows, hidden]`` tensor exists;
- every block's input is donated to the block streamplan streams (its residual updated in place), where the
  replacement at that index is streamplan's own; a foreign replacement gets the stock call (its input kept);
- the output head (final norm and modulation, projection) runs on row chunks straight into the head's small output,
  which the model's own unpatchify then lays out;
- Wan 2.2 TI2V's timestep per latent frame: the per-frame modulation table stock's ``repeat_e`` lays over every row
  reaches streamplan's blocks as a per-row table described per chunk (``_per_row``), the head's picked per chunk;
- in those row loops a comfy.ops layer that casts its weights per call (lowvram, DynamicVRAM, LoRA patches applied
  per call) casts them once per loop, not once per chunk (``forward_loops.row_loop``, ``weights.once_per_loop``).

The forward is written here against the model's source (never copied: ComfyUI's own helpers, layouts and submodules
are called), and followed only where that source's fingerprint is the one it was written for; a call it does not
cover (conditioning rows, references, other wrappers inside this one, autograd) runs the stock forward, and the report
says why."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...execute.call_state import rehearsing
from ...execute.chunk_loop import chunk_bounds
from ...specs import RowsFrom
from . import models as comfy_models
from .embed import grid_chunk_bounds  # noqa: F401 -- forwards' own
from .embed import grid_chunks, project_into, row_chunks
from .forward_budget import plans_ahead, run_planned
from .forward_loops import block_call, chunk_rows, row_loop
from .forwards_joint import Chroma, Flux, HunyuanVideo
from .forwards_ltxav import LTXAV
from .forwards_ltxv import LTXV

@dataclass(eq=False)
class ModelCalls:
    """What the wrapper did with the model calls of one patched clone."""

    streamed_calls: int = 0
    stock_reasons: dict[str, int] = field(default_factory=dict)
    chunk: int | None = None                 # rows per chunk of the last streamed call's own loops
    planned: dict = field(default_factory=dict)   # input signature -> the whole forward's figures (planned ahead)
    notes: list[str] = field(default_factory=list)   # what planning the forward ahead said
    loop_chunk: Any = None                   # while a forward planned ahead runs: its own loops' chunk (``state``)
    donated_blocks: int = 0                  # block calls of the last streamed call that got their input donated
    weights_once: int = 0                    # comfy.ops layers of the last streamed call's row loops cast once a loop

    def stock(self, reason: str) -> None:
        self.stock_reasons[reason] = self.stock_reasons.get(reason, 0) + 1


class ModelForward:
    """The wrapper: ``(executor, *args, **kwargs)`` as ComfyUI's ``WrapperExecutor`` calls it."""

    def __init__(self, state: Any):
        self.state = state

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        state, calls = self.state, self.state.forward
        model = executor.class_obj
        why, run = self._problem(executor, model)
        call = None
        if why is None:
            try:
                call = _bound(model, args, kwargs)
            except TypeError as exc:
                why = f"the call does not match {type(model).__name__}._forward ({exc})"
        if why is None:
            why = run.problem(model, call)
        if why is not None:
            calls.stock(why)
            return executor(*args, **kwargs)
        if rehearsing():   # a rehearsal of a forward outside (never counted)
            return run.forward(model, call, state)
        calls.weights_once = 0
        if plans_ahead(run, state.options):
            state.new_call(call.get("transformer_options") or {})   # a new sampling run plans anew, ahead
            # the values the forward decides on, read from the real call for its rehearsal (``rehearsal_inputs``)
            stand_ins: dict = {}
            read = getattr(run, "rehearsal_inputs", None)

            def forward(a: tuple, k: dict) -> Any:
                bound = _bound(model, a, k)
                return run.forward(model, {**bound, **stand_ins} if rehearsing() else bound, state)
            out = run_planned(state, model, forward, args, kwargs,
                              read_ahead=None if read is None else lambda: stand_ins.update(read(model, call)))
        else:
            out = run.forward(model, call, state)
        calls.streamed_calls += 1
        return out

    @staticmethod
    def _problem(executor: Any, model: Any):
        why = comfy_models.forward_problem(model)
        if why:
            return why, None
        inner = executor.wrappers[executor.idx + 1:]
        if inner:
            names = ", ".join(getattr(w, "__qualname__", type(w).__qualname__) for w in inner)
            return f"another DIFFUSION_MODEL wrapper runs inside streamplan's ({names})", None
        if model.training:
            return "the model is in training mode", None
        if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
            return "autograd is recording", None
        return None, FORWARDS[comfy_models.class_path(type(model))]


def _bound(model: Any, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by the names of the model's ``_forward`` (``self`` left out)."""
    call = dict(inspect.signature(type(model)._forward).bind(model, *args, **kwargs).arguments)
    call.pop(next(iter(call)))
    return call


def _wan_block_wrap(block, context_img_len, frames=None):
    """The "original_block" a Wan block replacement gets: the block called with the host's arguments (a closure over
    the block module, as the stock forward's, so a replacement may swap the module it calls). The block module itself
    (a call that stays stock) is handed ``frames``, the per-frame table the stock forward hands it, in place of the
    per-row table described for streamplan's streamed call (``_per_row``)."""
    def block_wrap(args):
        e = args["vec"]
        if isinstance(e, RowsFrom) and isinstance(block, nn.Module):
            e = frames
        return {"img": block(args["img"], context=args["txt"], e=e, freqs=args["pe"],
                             context_img_len=context_img_len, transformer_options=args["transformer_options"])}
    return block_wrap


def _h3_block_wrap(block):
    def block_wrap(args):
        return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                             transformer_options=args["transformer_options"])}
    return block_wrap


# --- Wan (comfy.ldm.wan.model.WanModel._forward and forward_orig, ComfyUI 0.33.0) ---------------------------------

def _row_step(entries: int, rows: int) -> int:
    """Rows per timestep entry as ``repeat_e`` (comfy.ldm.wan.model) lays a per-frame table over the rows: row ``i``
    reads entry ``i // step`` (``rows // entries``, or one more where that does not divide: it repeats each entry one
    row more and cuts the tail)."""
    step = rows // entries
    return step if step * entries == rows else step + 1


def _per_row(table: torch.Tensor, step: int, rows: int) -> RowsFrom:
    """A per-frame table ``[B, F, ...]`` as the per-row ``[B, rows, ...]`` one ``repeat_e`` makes of it, described: a
    chunk's rows picked from their frames' entries, so a streamed block reads a table with a row per row (its own
    ``repeat_e`` then leaves it as it is) and no chunk of it is ever over every row."""
    def make(a: int, b: int) -> torch.Tensor:
        return table[:, torch.arange(a, b, device=table.device) // step]
    return RowsFrom(make, torch.Size((table.shape[0], rows, *table.shape[2:])), table.dtype, table.device)


class _Wan:
    plans_ahead = True   # rehearsed whole under a size budget (``forward_budget``)

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        kwargs = call.get("kwargs") or {}
        if call.get("time_dim_concat") is not None:
            return "time_dim_concat is given (the stock forward joins it to the latent)"
        if kwargs.get("context_latents") is not None:
            return "context_latents are given (in-context reference streams)"
        if model.ref_conv is not None and "reference_latent" in kwargs:
            return "a reference_latent is given"
        x, t = call.get("x"), call.get("timestep")
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or not isinstance(t, torch.Tensor):
            return "x is not [batch, channels, frames, height, width]"
        if t.dim() == 0:
            return "the timestep is a scalar (the stock forward takes [batch] or [batch, frames])"
        entries = t.numel() // max(1, t.shape[0])
        if entries > 1:   # Wan 2.2 TI2V (model_base.WAN22): a timestep per latent frame, the first 0 under a mask
            grid = [-(-n // p) for n, p in zip(x.shape[2:], model.patch_size)]
            rows = grid[0] * grid[1] * grid[2]
            if t.shape[0] != x.shape[0]:
                return (f"the per-frame timesteps' batch ({t.shape[0]}) is not the latent's ({x.shape[0]}): the "
                        f"stock forward broadcasts its tables")
            if entries > grid[0]:
                return (f"{entries} timesteps per entry, more than the {grid[0]} latent frames (a time embedding "
                        f"over every row is the stock forward's)")
            if rows // entries == 1 and rows != entries:
                return (f"{entries} timesteps over {rows} rows: repeat_e leaves such a table as it is (the stock "
                        f"forward's)")
        return None

    @staticmethod
    def forward(model: Any, call: dict, state: Any) -> torch.Tensor:
        import comfy.ldm.common_dit as common_dit
        import comfy.model_management as mm
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        x, timestep, context = call["x"], call["timestep"], call["context"]
        clip_fea, options = call.get("clip_fea"), call.get("transformer_options", {})
        batch, _, frames_in, height, width = x.shape
        x = common_dit.pad_to_patch_size(x, model.patch_size)
        freqs = model.rope_encode(frames_in, height, width, device=x.device, dtype=x.dtype,
                                  transformer_options=options)
        pt, ph, pw = model.patch_size
        grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
        rows = grid[0] * grid[1] * grid[2]
        chunk = chunk_rows(state, x.device, model.dim * 6)

        # the patch embedding (fp32 Conv3d) a few frames at a time into one contiguous buffer of the model's dtype
        hidden = torch.empty(batch, rows, model.dim, dtype=x.dtype, device=x.device)
        with row_loop(state, model.patch_embedding):
            project_into(hidden, grid_chunks(x, model.patch_size, chunk),
                         lambda p: model.patch_embedding(p.float()).flatten(2).transpose(1, 2))
        options["grid_sizes"] = torch.Size(grid)

        # the time tables as stock computes them: [B, 1, ...], or [B, F, ...] for a timestep per latent frame
        e = model.time_embedding(sinusoidal_embedding_1d(model.freq_dim, timestep.flatten()).to(dtype=hidden.dtype))
        e = e.reshape(timestep.shape[0], -1, e.shape[-1])
        e0 = model.time_projection(e).unflatten(2, (6, model.dim))
        # per frame: stock's repeat_e makes each block's six modulations a table over every row; streamplan's
        # streamed blocks get it described (a chunk's rows built as they are read), a stock block the frames' table
        step = _row_step(e0.shape[1], rows) if e0.shape[1] > 1 else None
        streamed_e0 = e0 if step is None else _per_row(e0, step, rows)
        context = model.text_embedding(context)
        context_img_len = None
        if clip_fea is not None:
            if model.img_emb is not None:
                context = torch.concat([model.img_emb(clip_fea), context], dim=1)
            context_img_len = clip_fea.shape[-2]

        blocks_replace = options.get("patches_replace", {}).get("dit", {})
        patches = options.get("patches", {})
        options["total_blocks"] = len(model.blocks)
        options["block_type"] = "double"
        donated = 0
        for i, block in enumerate(model.blocks):
            options["block_index"] = i
            key = ("double_block", i)
            if key in blocks_replace:
                block_wrap = _wan_block_wrap(block, context_img_len, e0)
                ours = getattr(blocks_replace[key], "streamplan_donates", False)
                args = {"img": hidden, "txt": context, "vec": streamed_e0 if ours else e0, "pe": freqs,
                        "transformer_options": options}
                hidden, gave = block_call(blocks_replace, key, hidden, args, block_wrap)
                del args
                donated += gave
            else:
                hidden = block(hidden, e=e0, freqs=freqs, context=context, context_img_len=context_img_len,
                               transformer_options=options)
            for p in patches.get("double_block", ()):
                # the stock forward's own post-block patches, with its arguments (x: the latent it was given)
                hidden = p({"img": hidden, "x": x, "vec": e, "block_index": i, "img_offset": 0,
                            "transformer_options": options})["img"]
        state.forward.donated_blocks = donated
        del streamed_e0

        # the head: modulated norm and projection on row chunks into its (small) output, then the model's unpatchify;
        # its shift and scale per frame as stock's, each chunk's rows picked from their frames' (repeat_e's layout)
        if state.forward.loop_chunk is not None:   # planned ahead: the chunk its blocks planned
            chunk = chunk_rows(state, x.device, model.dim * 6)
        head = model.head
        mod = mm.cast_to(head.modulation, dtype=hidden.dtype, device=hidden.device)
        shift, scale = (mod.unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        out = None
        with row_loop(state, head):
            for a, b in chunk_bounds(rows, chunk):
                r = hidden[:, a:b]
                if step is None:
                    sh, sc = shift, scale
                else:
                    frame = torch.arange(a, b, device=hidden.device) // step
                    sh, sc = shift[:, frame], scale[:, frame]
                y = head.head(torch.addcmul(sh, head.norm(r), 1 + sc))
                if out is None:
                    out = y.new_empty(batch, rows, y.shape[-1])
                out[:, a:b] = y
                del r, y, sh, sc
        del hidden
        return model.unpatchify(out, torch.Size(grid))[:, :, :frames_in, :height, :width]


# --- MiniMax-H3 (comfy.ldm.minimax.model.MiniMaxH3Model._forward, ComfyUI 0.33.0) ---------------------------------

_H3_KINDS = {"text", "audio", "video"}
_H3_TAG = {"text": 1, "video": 0, "audio": 2}


class _H3:
    plans_ahead = True

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x = call.get("x")
        if not isinstance(x, (list, tuple)) or len(x) != 2 or not all(isinstance(v, torch.Tensor) for v in x):
            return "x is not the [video, audio] latent pair"
        if x[0].dim() != 5 or x[0].shape[0] != 1:
            return "the video latent is not [1, channels, frames, height, width]"
        payload = call.get("minimax_payload") or {}
        for key in ("keyframes", "refs", "cond_video_latents", "cond_audio_latents"):
            if payload.get(key):
                return f"minimax_payload has {key} (conditioning and reference rows keep the stock forward)"
        layout = payload.get("layout")
        if layout is not None and not {k for _, _, k in layout.segments} <= _H3_KINDS:
            return "the packed layout has segments other than text, audio and video"
        return None

    @staticmethod
    def forward(model: Any, call: dict, state: Any) -> list:
        import comfy.ldm.common_dit as common_dit
        import comfy.ldm.minimax.model as h3
        import comfy.model_management as mm
        import comfy.model_prefetch as prefetch

        x, timestep, context = call["x"], call["timestep"], call["context"]
        options, payload = call.get("transformer_options", {}), call.get("minimax_payload") or {}
        video_x, audio_x = x[0], x[1]
        orig_t, orig_h, orig_w = video_x.shape[2:]
        video_x = common_dit.pad_to_patch_size(video_x, model.patch_size)
        device, dtype = video_x.device, context.dtype
        latent_t, lat_h, lat_w = video_x.shape[2:]
        audio_t, text_len = audio_x.shape[-1], context.shape[1]
        layout = payload.get("layout")
        if layout is None or layout.signature != (text_len, latent_t, lat_h, lat_w, audio_t):
            layout = h3.PackedLayout(text_len, latent_t, lat_h, lat_w, audio_t)
        seg = {k: (a, b) for a, b, k in layout.segments}

        # the timestep of each stream and its row in the modulation tables; every segment's table row
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        shift_v = float(options.get("minimax_h3_sigma_shift_video", model.sigma_shift_video))
        shift_a = float(options.get("minimax_h3_sigma_shift_audio", model.sigma_shift_audio))
        t_of = {"video": float(1.0 - sigma_v), "audio": float(1.0 - h3.time_shift_sigma(sigma_v, shift_v, shift_a))}
        t_of["text"] = t_of["video"]
        ts = sorted(set(t_of.values()))
        table_row = {kind: ts.index(t) * 3 for kind, t in t_of.items()}
        mod_segments = []
        tags = payload.get("text_token_tags")
        for a, b, kind in layout.segments:
            if kind == "text" and tags is not None:
                runs = tags.view(-1).tolist()[:b - a]
                start = 0
                for i in range(1, len(runs) + 1):   # each run of equal tags is its own segment
                    if i == len(runs) or runs[i] != runs[start]:
                        mod_segments.append((a + start, a + i, table_row[kind] + int(runs[start])))
                        start = i
            else:
                mod_segments.append((a, b, table_row[kind] + _H3_TAG[kind]))

        chunk = chunk_rows(state, device, model.hidden_size * 6)
        h = torch.empty(layout.seq_len, model.hidden_size, dtype=dtype, device=device)

        # video rows: patchified and projected (fp32) a few latent frames at a time, written into h as the model dtype
        with row_loop(state, model.video_patch_proj):
            project_into(h[slice(*seg["video"])], grid_chunks(video_x, model.patch_size, chunk),
                         lambda p: model.video_patch_proj(h3.patchify_video(p.to(torch.float32), model.patch_size)))
        audio_rows = h3.pack_audio(audio_x.to(torch.float32))
        with row_loop(state, model.audio_patch_proj):
            project_into(h[slice(*seg["audio"])], row_chunks(audio_rows, chunk, dim=0), model.audio_patch_proj)
        del audio_rows
        text = context[0]
        if text.shape[-1] != model.hidden_size:
            text = model.token_refiner(model.condition_proj(text), transformer_options=options)
        h[slice(*seg["text"])] = text
        del text

        t_vals = torch.tensor(ts, dtype=torch.float32, device=device)
        if model.use_adaln_curves:
            grid = mm.cast_to(model.adaln_t_table, device=device)
            pos = t_vals.clamp(0.0, 1.0) * (grid.shape[0] - 1)
            lo = pos.floor().long().clamp(max=grid.shape[0] - 2)
            t_emb = torch.lerp(grid[lo], grid[lo + 1], (pos - lo).unsqueeze(1))
        else:
            t_emb = model.time_embedder(t_vals).to(dtype)
        rope = h3.rope_rotation_table(model.rope_freqs(layout.position_ids, device), dtype)

        blocks_replace = options.get("patches_replace", {}).get("dit", {})
        queue = prefetch.make_prefetch_queue(list(model.blocks), device, options)
        donated = 0
        for i, block in enumerate(model.blocks):
            prefetch.prefetch_queue_pop(queue, device, block)
            if ("double_block", i) in blocks_replace:
                block_wrap = _h3_block_wrap(block)
                args = {"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope,
                        "transformer_options": options}
                h, gave = block_call(blocks_replace, ("double_block", i), h, args, block_wrap)
                del args
                donated += gave
            else:
                h = block(h, t_emb, mod_segments, rope, transformer_options=options)
        if queue is not None:
            prefetch.prefetch_queue_pop(queue, device, None)
        state.forward.donated_blocks = donated
        del rope

        # the final layer on row chunks of each target stream, straight into its (small, fp32) output
        if state.forward.loop_chunk is not None:   # planned ahead: the chunk its blocks planned
            chunk = chunk_rows(state, device, model.hidden_size * 6)
        final = model.final_layer
        shift, scale = final.adaln_proj(t_emb)
        outs = []
        with row_loop(state, final.norm, final.video_out, final.audio_out):
            for kind, proj in (("video", final.video_out), ("audio", final.audio_out)):
                a0, b0 = seg[kind]
                row = ts.index(t_of[kind])
                out = None
                for a, b in chunk_bounds(b0 - a0, chunk):
                    y = proj((final.norm(h[a0 + a:a0 + b]) * (1.0 + scale[row]) + shift[row]).to(torch.float32))
                    if out is None:
                        out = y.new_empty(b0 - a0, y.shape[-1])
                    out[a:b] = y
                    del y
                outs.append(out)
        del h
        video = h3.unpatchify_video(outs[0], latent_t, lat_h // 2, lat_w // 2, model.latents_dim, model.patch_size)
        video = video[:, :, :orig_t, :orig_h, :orig_w]
        return [-video.to(video_x.dtype), -h3.unpack_audio(outs[1]).to(audio_x.dtype)]


# every model class streamplan follows (a key of ``models.KNOWN``, whose fingerprints gate it) -> its forward:
# ``problem(model, call) -> str | None`` (why this call keeps the stock forward) and ``forward(model, call, state)``
# (the call streamed), ``call`` the bound arguments of the model's ``_forward``; optionally ``plans_ahead`` (rehearsed
# whole under a size budget, ``forward_budget``) and ``rehearsal_inputs(model, call) -> dict`` (values the forward
# decides on, read from the real call and handed to its rehearsal in ``call``)
FORWARDS: dict[str, Any] = {
    comfy_models.WAN_PATH: _Wan,
    comfy_models.H3_PATH: _H3,
    comfy_models.FLUX_PATH: Flux,
    comfy_models.CHROMA_PATH: Chroma,
    comfy_models.HUNYUAN_VIDEO_PATH: HunyuanVideo,
    comfy_models.LTXV_PATH: LTXV,
    comfy_models.LTXAV_PATH: LTXAV,
}
