"""MiniMax-H3 (diffusers ``MiniMaxH3Transformer3DModel``): its model forward with the packed sequence built in place,
every block's input donated, and both output heads run chunk by chunk straight into their own outputs. The blocks
themselves stream from their captured graph (``streamplan.graph``): per-row AdaLN rows, per-head q/k norms and the
partial rotary are all row-local there."""
from __future__ import annotations

import sys
import torch
from torch import nn

from ...execute.chunk_loop import for_chunks
from ...execute.donation import donate
from ...execute import host_rows
from ...execute.hook_chains import keeps_output, takes_described
from ...specs import HostRows, ModelSpec, RowLoops, Skip, described_whole
from .parallel import model_config
from ...recognize.checks import stock_problem
from .models import KNOWN_FORWARDS, call_problem, left_stock, model_call, unknown_forward

_MODULE = "diffusers.models.transformers.transformer_minimax_h3"
_ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices", "token_tags",
         "position_ids", "video_indices", "audio_indices", "text_indices", "attention_kwargs", "return_dict")
KNOWN_FORWARDS["MiniMaxH3Transformer3DModel"] = {"f4de984e8443866c": "diffusers 0.42.1"}


def _call(args: tuple, kwargs: dict) -> dict | str:
    call = model_call(_ARGS, args, kwargs)
    if isinstance(call, str):
        return call
    missing = [k for k in _ARGS[:10] if not isinstance(call.get(k), torch.Tensor)]
    if missing:
        return f"tensor arguments missing: {missing}"
    return call


def _scatter_rows(dst: torch.Tensor | HostRows, proj: nn.Module, src: torch.Tensor, index: torch.Tensor,
                  chunk: int) -> None:
    """``dst[:, index] = proj(src)`` a chunk of source rows at a time (stock projects every row, then copies)."""
    dtype = next(proj.parameters()).dtype
    dst_dtype = dst.tensor.dtype if isinstance(dst, HostRows) else dst.dtype

    def work(a: int, b: int) -> None:
        host_rows.placed(dst, index[a:b], proj(src[:, a:b].to(dtype)).to(dst_dtype))

    for_chunks(src.shape[1], chunk, work)


def _forward(model, args: tuple, kwargs: dict, chunk: RowLoops):
    """MiniMaxH3Transformer3DModel.forward (diffusers 0.42.1), streamed; with ``chunk.host`` (L6) the packed
    sequence in host memory between blocks."""
    mod = sys.modules[_MODULE]
    call = _call(args, kwargs)
    position_ids, token_tags, timestep_indices = call["position_ids"], call["token_tags"], call["timestep_indices"]
    if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
        raise ValueError(f"`position_ids` must be a `(seq_len, 3)` tensor, got {list(position_ids.shape)}.")
    n = position_ids.shape[0]
    if token_tags.shape != (n,) or timestep_indices.shape != (n,):
        raise ValueError(
            "`token_tags` and `timestep_indices` must both be `(seq_len,)` tensors matching `position_ids`, got "
            f"{list(token_tags.shape)} and {list(timestep_indices.shape)} for seq_len={n}.")
    video_indices, audio_indices = call["video_indices"], call["audio_indices"]
    rotary_emb = model.rope(position_ids)

    text = call["encoder_hidden_states"]
    text = model.context_embedder(text.to(next(model.context_embedder.parameters()).dtype))
    text = model.token_refiner(text)
    device = text.device
    if chunk.host:
        hidden_states = HostRows(host_rows.host_empty((text.shape[0], n, text.shape[-1]), text.dtype, device), device)
        hidden_states.tensor.zero_()
    else:
        hidden_states = text.new_zeros((text.shape[0], n, text.shape[-1]))
    host_rows.placed(hidden_states, call["text_indices"], text)
    del text
    _scatter_rows(hidden_states, model.proj_in, call["hidden_states"], video_indices, chunk())
    _scatter_rows(hidden_states, model.audio_proj_in, call["audio_hidden_states"], audio_indices, chunk())

    temb = model.time_proj(call["timestep"])
    temb = model.time_embedder(temb.to(next(model.time_embedder.parameters()).dtype))
    adaln_indices = timestep_indices * mod.MINIMAX_H3_MODALITY_NUM + token_tags

    kept = None   # a block whose hook keeps its output (a cache) does not hand it to the next to overwrite
    for block in model.transformer_blocks:
        inputs = (hidden_states, temb, adaln_indices, rotary_emb)
        if chunk.host and not takes_described(block):   # a block streamplan does not stream: its rows whole
            inputs, _ = described_whole(inputs, {})
        with donate(*(() if kept else (inputs[0],))):
            out = block(*inputs)
        del inputs
        hidden_states = host_rows.kept(out, hidden_states) if chunk.host else out
        del out
        kept = keeps_output(block)

    # each head on the rows it keeps only, a chunk of them at a time, straight into its output (stock runs both
    # heads over every row in float32 and selects afterwards)
    head_dtype = next(model.proj_out.parameters()).dtype
    heads = []
    for proj, index in ((model.proj_out, video_indices), (model.audio_proj_out, audio_indices)):
        out = torch.empty((hidden_states.shape[0], index.shape[0], proj.out_features),
                          dtype=next(proj.parameters()).dtype, device=device)

        def work(a: int, b: int, proj=proj, index=index, out=out) -> None:
            rows = index[a:b]
            y = model.norm_out(host_rows.picked(hidden_states, rows), temb, timestep_indices.index_select(0, rows))
            out[:, a:b] = proj(y.to(head_dtype)).to(out.dtype)

        for_chunks(index.shape[0], chunk(), work)
        heads.append((proj, index, out))
    video_output, audio_output = heads[0][2], heads[1][2]
    if not call.get("return_dict", True):
        return (video_output, audio_output)
    return mod.MiniMaxH3TransformerOutput(sample=video_output, audio_sample=audio_output)


def _can_stream(model, args: tuple, kwargs: dict) -> str | None:
    return call_problem(model, _call(args, kwargs))


def recognize_h3_model(name: str, module: nn.Module) -> ModelSpec | Skip | None:
    mod = sys.modules.get(_MODULE)
    if mod is None or not isinstance(module, mod.MiniMaxH3Transformer3DModel):
        return None
    skip = lambda why: left_stock(name, module, why)  # noqa: E731
    unknown = unknown_forward(name, module, mod.MiniMaxH3Transformer3DModel)
    if unknown:
        return unknown
    if model_config(module) is not None:   # not followed yet: the packed sequence would be built on every rank whole
        return skip("context parallelism is enabled: the model forward runs stock, its blocks stream inside "
                    "diffusers' split and gather hooks")
    for sub in ("rope", "proj_in", "audio_proj_in", "context_embedder", "token_refiner", "time_proj", "time_embedder",
                "norm_out", "proj_out", "audio_proj_out"):
        problem = stock_problem(getattr(module, sub), per_chunk=sub in ("norm_out", "proj_out", "audio_proj_out"))
        if problem:
            return skip(f"{sub}: {problem}")
    return ModelSpec(module, "diffusers.MiniMaxH3Transformer3DModel[packed in place, donated blocks, streamed heads]",
                     run=lambda args, kwargs, chunk: _forward(module, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _can_stream(module, args, kwargs), host_rows=True)
