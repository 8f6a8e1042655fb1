"""The streamed forward of ComfyUI's LTX-Video (``comfy.ldm.lightricks.model.LTXVModel``, 0.33.0).

The stock forward keeps each block's input alive while the block builds its output (a second whole-sequence residual
per block) and runs its output head (norm, scale-shift modulation, projection) over every row at once (two more
``[rows, hidden]`` tensors). Streamed: the model's own helpers prepare rows, timesteps, text, masks and rope as the
stock forward does; each block's input is donated to streamplan's own block replacement (the residual updated in
place); the head runs on row chunks into its small output, which the model's patchifier lays out.

Keyframe (guide) conditioning keeps the stock forward (its rows are filtered and its head output scattered back). The
audio-video model (LTX-2's ``LTXAVModel``, a subclass with its own forward) has its own streamed forward
(``forwards_ltxav``)."""
from __future__ import annotations

import math
from typing import Any

import torch

from ...execute.chunk_loop import chunk_bounds
from .forward_loops import block_call, chunk_rows, row_loop


def _block_wrap(block):
    """The "original_block" the host hands a block replacement (a closure over the block module alone)."""
    def block_wrap(args):
        return {"img": block(args["img"], context=args["txt"], attention_mask=args["attention_mask"],
                             timestep=args["vec"], pe=args["pe"], transformer_options=args["transformer_options"],
                             self_attention_mask=args.get("self_attention_mask"),
                             prompt_timestep=args.get("prompt_timestep"))}
    return block_wrap


class LTXV:
    plans_ahead = True   # rehearsed whole under a size budget (``forward_budget``)

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x, keyframes = call.get("x"), call.get("keyframe_idxs")
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            return "x is not [batch, channels, frames, height, width]"
        if keyframes is not None and keyframes.shape[2] > 0:
            return "keyframe_idxs are given (guide rows are filtered and the head's rows scattered back)"
        return None

    @staticmethod
    def forward(model: Any, call: dict, state: Any) -> torch.Tensor:
        x, timestep, context, attention_mask = call["x"], call["timestep"], call["context"], call["attention_mask"]
        frame_rate, options = call.get("frame_rate", 25), call.get("transformer_options", {})
        keyframe_idxs, denoise_mask = call.get("keyframe_idxs"), call.get("denoise_mask")
        input_dtype, batch = x.dtype, x.shape[0]
        merged = {**options, **(call.get("kwargs") or {})}
        x, pixel_coords, extra = model._process_input(x, keyframe_idxs, denoise_mask, **merged)
        merged.update(extra)
        timestep, embedded_timestep, prompt_timestep = model._prepare_timestep(timestep, batch, input_dtype,
                                                                               **merged)
        merged["prompt_timestep"] = prompt_timestep
        context, attention_mask = model._prepare_context(context, batch, x, attention_mask)
        attention_mask = model._prepare_attention_mask(attention_mask, input_dtype)
        pe = model._prepare_positional_embeddings(pixel_coords, frame_rate, input_dtype)
        del pixel_coords
        self_attention_mask = model._build_guide_self_attention_mask(x, options, merged)

        blocks_replace = options.get("patches_replace", {}).get("dit", {})
        donated = 0
        for i, block in enumerate(model.transformer_blocks):
            if ("double_block", i) in blocks_replace:
                args = {"img": x, "txt": context, "attention_mask": attention_mask, "vec": timestep, "pe": pe,
                        "transformer_options": options, "self_attention_mask": self_attention_mask,
                        "prompt_timestep": prompt_timestep}
                x, gave = block_call(blocks_replace, ("double_block", i), x, args, _block_wrap(block))
                del args
                donated += gave
            else:
                x = block(x, context=context, attention_mask=attention_mask, timestep=timestep, pe=pe,
                          transformer_options=options, self_attention_mask=self_attention_mask,
                          prompt_timestep=prompt_timestep)
        state.forward.donated_blocks = donated
        del pe, context

        # the head: norm, scale-shift and projection on row chunks into its (small) output
        rows = x.shape[1]
        chunk = chunk_rows(state, x.device, model.inner_dim * 6)
        table = model.scale_shift_table[None, None].to(device=x.device, dtype=x.dtype) + embedded_timestep[:, :, None]
        shift, scale = table[:, :, 0], table[:, :, 1]
        out = None
        with row_loop(state, model.norm_out, model.proj_out):   # their weights cast once, not per chunk
            for a, b in chunk_bounds(rows, chunk):
                sh = shift if shift.shape[1] == 1 else shift[:, a:b]
                sc = scale if scale.shape[1] == 1 else scale[:, a:b]
                y = model.proj_out(model.norm_out(x[:, a:b]) * (1 + sc) + sh)
                if out is None:
                    out = y.new_empty(batch, rows, y.shape[-1])
                out[:, a:b] = y
                del y
        del x
        orig_shape = merged["orig_shape"]
        return model.patchifier.unpatchify(latents=out, output_height=orig_shape[3], output_width=orig_shape[4],
                                           output_num_frames=orig_shape[2],
                                           out_channels=orig_shape[1] // math.prod(model.patchifier.patch_size))
