"""Wan (diffusers ``WanTransformer3DModel``): the model forward with donated block inputs and a streamed output head.
Its blocks stream from their captured graph (measured on the H200 within 3% of the hand-written block path this file
held before, in memory and time, so that path was removed)."""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from ..executors.chunks import for_chunks
from ..executors.donation import donate
from ..hooks import keeps_output
from ..ir import ModelSpec, Skip
from .checks import stock_problem
from .diffusers_models import KNOWN_FORWARDS, _own_forward_problem, call_problem, model_call
from .rows import rows_of

KNOWN_FORWARDS["WanTransformer3DModel"] = {"24661a03f570e853": "diffusers 0.42.1"}


_WAN_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image", "return_dict",
             "attention_kwargs")


def _wan_call(args: tuple, kwargs: dict) -> dict | str:
    return model_call(_WAN_ARGS, args, kwargs)


def _wan_forward(model, args: tuple, kwargs: dict, chunk: Callable[[], int]):
    """WanTransformer3DModel.forward (diffusers 0.35+) with each block's input donated and the head streamed."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    call = _wan_call(args, kwargs)
    hidden_states, timestep = call["hidden_states"], call["timestep"]
    encoder_hidden_states = call["encoder_hidden_states"]
    encoder_hidden_states_image = call.get("encoder_hidden_states_image")
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    post_f, post_h, post_w = num_frames // p_t, height // p_h, width // p_w

    rotary_emb = model.rope(hidden_states)
    hidden_states = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    if timestep.ndim == 2:
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len)
    timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    kept = None   # a block whose hook keeps its output (a cache) does not hand it to the next to overwrite
    for block in model.blocks:
        with donate(*(() if kept else (hidden_states,))):
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
        kept = keeps_output(block)

    if temb.ndim == 3:
        shift, scale = (model.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden_states.device), scale.to(hidden_states.device)
    rows = hidden_states.shape[1]
    head: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        r = hidden_states[:, a:b]  # noqa: F821 (deleted after the loop, to free it before the reshape)
        y = (model.norm_out(r.float()) * (1 + rows_of(scale, a, b, 1)) + rows_of(shift, a, b, 1)).type_as(r)
        y = model.proj_out(y)
        if not head:  # noqa: F821
            head.append(y.new_empty((batch_size, rows, y.shape[-1])))  # noqa: F821
        head[0][:, a:b] = y  # noqa: F821

    for_chunks(rows, chunk(), work)
    out = head[0]
    del hidden_states, head
    out = out.reshape(batch_size, post_f, post_h, post_w, p_t, p_h, p_w, -1)
    out = out.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    if not call.get("return_dict", True):
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _wan_can_stream(model, args: tuple, kwargs: dict) -> str | None:
    call = _wan_call(args, kwargs)
    problem = call_problem(model, call)
    if problem:
        return problem
    x = call.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or call.get("timestep") is None:
        return "hidden_states is not [batch, channels, frames, height, width]"
    return None


def recognize_wan_model(name: str, module: nn.Module) -> ModelSpec | Skip | None:
    mod = sys.modules.get("diffusers.models.transformers.transformer_wan")
    if mod is None or not isinstance(module, mod.WanTransformer3DModel):
        return None
    skip = lambda why: Skip(name, type(module).__name__, f"model forward left stock: {why}")  # noqa: E731
    problem = _own_forward_problem(module, mod.WanTransformer3DModel)
    if problem:
        return skip(problem)
    for sub in ("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"):
        # called through their own forwards: weight hooks inside them run as in stock (streamplan.hooks); the head's
        # are called once per row chunk, so only weight hooks on them (a cache hook would count chunks as steps)
        problem = stock_problem(getattr(module, sub), onloads=True, per_chunk=sub in ("norm_out", "proj_out"))
        if problem:
            return skip(f"{sub}: {problem}")
    return ModelSpec(module, "diffusers.WanTransformer3DModel[donated blocks, streamed head]",
                     run=lambda args, kwargs, chunk: _wan_forward(module, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _wan_can_stream(module, args, kwargs))
