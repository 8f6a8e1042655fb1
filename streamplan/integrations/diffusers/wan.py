"""Wan (diffusers ``WanTransformer3DModel``): the model forward with donated block inputs and a streamed output head.
Its blocks stream from their captured graph, which is as fast and as small as a hand-written block path, so none is
kept."""
from __future__ import annotations

import sys
import torch
from torch import nn

from ...execute.chunk_loop import for_chunks
from ...execute.donation import donate
from ...execute import host_rows
from ...execute.hook_chains import keeps_output, takes_described
from ...execute.row_tables import DistinctRows
from ...specs import HostRows, ModelSpec, RowLoops, Skip, described_whole
from ...recognize.checks import stock_problem
from . import parallel as cp
from .models import KNOWN_FORWARDS, call_problem, left_stock, model_call, unknown_forward
from ...recognize.rows import rows_of

KNOWN_FORWARDS["WanTransformer3DModel"] = {"24661a03f570e853": "diffusers 0.42.1"}


_WAN_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image", "return_dict",
             "attention_kwargs")


def _wan_call(args: tuple, kwargs: dict) -> dict | str:
    return model_call(_WAN_ARGS, args, kwargs)


def _wan_forward(model, args: tuple, kwargs: dict, chunk: RowLoops):
    """WanTransformer3DModel.forward (diffusers 0.35+) with each block's input donated and the head streamed; with
    ``chunk.host`` (L6) the hidden state and rotary tables in host memory between blocks."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    call = _wan_call(args, kwargs)
    hidden_states, timestep = call["hidden_states"], call["timestep"]
    encoder_hidden_states = call["encoder_hidden_states"]
    encoder_hidden_states_image = call.get("encoder_hidden_states_image")
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    post_f, post_h, post_w = num_frames // p_t, height // p_h, width // p_w

    rotary_emb = model.rope(hidden_states)   # under context parallelism its hook splits it to the rank's rows
    parallel = cp.model_config(model)
    total = post_f * post_h * post_w
    device = hidden_states.device
    if chunk.host:   # L6 (never under context parallelism: can_stream): the rotary tables' rows off the device too
        rotary_emb = tuple(host_rows.to_host(t, device) if isinstance(t, torch.Tensor) and t.dim() > 1
                           and t.shape[1] == total else t for t in rotary_emb)
    if parallel is None:   # a few frames of patches at a time into one buffer: no whole conv output beside its copy
        hidden_states = _patches(model, hidden_states, 0, total, chunk(), chunk.host)
    else:   # only this rank's rows, as the first block's split hook would cut them
        hidden_states = _patches(model, hidden_states, *cp.split_rows(total, parallel), chunk())
        # the rope's split hook hands back views of the whole tables: copies of this rank's rows let those go
        rotary_emb = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in rotary_emb)
    distinct = None
    if timestep.ndim == 2 and parallel is None and timestep.shape == (batch_size, total) and total > 1:
        # a timestep per row (Wan 2.2's expand_timesteps): the modulation once per distinct timestep, picked per row
        distinct = DistinctRows(timestep)
        temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
            distinct.values, encoder_hidden_states, encoder_hidden_states_image)
        timestep_proj = distinct.rows_of(timestep_proj.unflatten(1, (6, -1)))
    else:
        ts_seq_len = timestep.shape[1] if timestep.ndim == 2 else None
        temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
            timestep.flatten() if ts_seq_len else timestep, encoder_hidden_states, encoder_hidden_states_image,
            timestep_seq_len=ts_seq_len)
        timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    kept = None   # a block whose hook keeps its output (a cache) does not hand it to the next to overwrite
    for block in model.blocks:
        inputs = (hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
        if not takes_described(block):   # a block streamplan does not stream: host rows and per-row tables whole
            inputs, _ = described_whole(inputs, {})
        with donate(*(() if kept else (inputs[0],))), cp.without_split(block):   # rows split above
            out = block(*inputs)
        del inputs
        hidden_states = host_rows.kept(out, hidden_states) if chunk.host else out
        del out
        kept = keeps_output(block)

    def modulation(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's shift and scale from the time embedding ``t`` (per batch, or per row)."""
        if t.ndim == 3:
            shift, scale = (model.scale_shift_table.unsqueeze(0).to(t.device) + t.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (model.scale_shift_table.to(t.device) + t.unsqueeze(1)).chunk(2, dim=1)
        return shift.to(device), scale.to(device)

    whole = modulation(temb) if distinct is None else None

    def rows_modulation(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if whole is None:   # per-row timesteps: this chunk's rows of the distinct timesteps' embeddings
            return modulation(distinct.pick(temb, a, b))
        return rows_of(whole[0], a, b, 1), rows_of(whole[1], a, b, 1)

    rows = hidden_states.shape[1]
    head: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        r = host_rows.rows(hidden_states, a, b)  # noqa: F821 (deleted after the loop, to free it before the reshape)
        shift, scale = rows_modulation(a, b)
        y = (model.norm_out(r.float()) * (1 + scale) + shift).type_as(r)
        with cp.without_gather(model.proj_out):   # gathered once, below
            y = model.proj_out(y)
        if not head:  # noqa: F821
            head.append(y.new_empty((batch_size, rows, y.shape[-1])))  # noqa: F821
        head[0][:, a:b] = y  # noqa: F821

    for_chunks(rows, chunk(), work)
    out = head[0]
    del hidden_states, head
    if parallel is not None:
        out = cp.gather_once(model.proj_out, out)
    out = out.reshape(batch_size, post_f, post_h, post_w, p_t, p_h, p_w, -1)
    out = out.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    if not call.get("return_dict", True):
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _patches(model, x: torch.Tensor, a: int, b: int, chunk: int, host: bool = False) -> torch.Tensor | HostRows:
    """The patch embedding of rows [a, b) (rows run frame by frame, height, width), a few frames of patches at a time
    into one [batch, rows, dim] buffer (in host memory with ``host``). The convolution's stride is its kernel, so a
    frame's patches read that frame's pixels alone."""
    p_t, p_h, p_w = model.config.patch_size
    B, _, F, H, W = x.shape
    per_frame = (H // p_h) * (W // p_w)
    out = None
    f = a // per_frame
    step = max(1, chunk // per_frame)
    while f * per_frame < b:
        g = min(f + step, -(-b // per_frame))
        y = model.patch_embedding(x[:, :, f * p_t:g * p_t]).flatten(2).transpose(1, 2)
        lo, hi = max(a, f * per_frame), min(b, g * per_frame)
        if out is None:
            shape = (B, b - a, y.shape[-1])
            out = host_rows.host_empty(shape, y.dtype, y.device) if host else y.new_empty(shape)
        out[:, lo - a:hi - a].copy_(y[:, lo - f * per_frame:hi - f * per_frame], non_blocking=True)
        del y
        f = g
    return HostRows(out, x.device) if host else out


def _parallel_problem(model) -> str | None:
    """Why the model forward keeps stock under this context-parallel setup (None: streams inside its hooks)."""
    parallel = cp.model_config(model)
    if parallel is None:
        return None
    if parallel.ulysses_anything or parallel.ring_anything:
        return "context parallelism with uneven rows (ulysses_anything / ring_anything)"
    split = cp.split_hook(model.blocks[0]) if len(model.blocks) else None
    if split is None or set(split.metadata) != {"hidden_states"}:
        return "context parallelism without the cp_plan streamplan follows (blocks.0 splits hidden_states alone)"
    if any(cp.split_hook(b) is not None for b in model.blocks[1:]):
        return "context parallelism splits the inputs of blocks after the first"
    gather = cp.gather_hook(model.proj_out)
    if gather is None or [m.gather_dim for m in gather.metadata] != [1]:
        return "context parallelism without the cp_plan streamplan follows (proj_out gathers its rows)"
    return None


def _wan_can_stream(model, args: tuple, kwargs: dict) -> str | None:
    call = _wan_call(args, kwargs)
    problem = call_problem(model, call)
    if problem:
        return problem
    x = call.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or call.get("timestep") is None:
        return "hidden_states is not [batch, channels, frames, height, width]"
    problem = _parallel_problem(model)
    if problem:
        return problem
    parallel = cp.model_config(model)
    if parallel is not None:
        p_t, p_h, p_w = model.config.patch_size
        rows = (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        if cp.split_rows(rows, parallel) is None:
            return f"context parallelism: {rows} rows do not divide over the ranks"
    return None


def recognize_wan_model(name: str, module: nn.Module) -> ModelSpec | Skip | None:
    mod = sys.modules.get("diffusers.models.transformers.transformer_wan")
    if mod is None or not isinstance(module, mod.WanTransformer3DModel):
        return None
    skip = lambda why: left_stock(name, module, why)  # noqa: E731
    unknown = unknown_forward(name, module, mod.WanTransformer3DModel)
    if unknown:
        return unknown
    for sub in ("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"):
        # called through their own forwards: weight hooks inside them run as in stock (streamplan.execute.hook_chains);
        # the patch embedding and the head are called once per row chunk, so only weight hooks on them (a cache hook
        # would count chunks as steps)
        if cp.only_cp_hooks(getattr(module, sub)):   # context parallelism's boundaries: checked per call
            continue
        problem = stock_problem(getattr(module, sub), onloads=True,
                                per_chunk=sub in ("patch_embedding", "norm_out", "proj_out"))
        if problem:
            return skip(f"{sub}: {problem}")
    return ModelSpec(module, "diffusers.WanTransformer3DModel[donated blocks, streamed head]",
                     run=lambda args, kwargs, chunk: _wan_forward(module, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _wan_can_stream(module, args, kwargs),
                     host_rows=cp.model_config(module) is None)
