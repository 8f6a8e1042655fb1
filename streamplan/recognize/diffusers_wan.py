"""Wan (diffusers ``WanAttention``, ``WanTransformerBlock``, ``WanTransformer3DModel``): everything streamplan knows by
hand about the family, in one place: the attention with its rotary and fused projections, the block streamed whole,
and the model forward with donated block inputs and a streamed output head."""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from ..consumers import consumer_for, unsupported
from ..executors.attention import attend_rows
from ..executors.block import donate
from ..executors.chunks import for_chunks
from ..executors.mlp import MLPRunner
from ..ir import AttentionCall, AttentionSpec, BlockCall, BlockSpec, ModelSpec, Segment, Skip, Stream
from .checks import call_args, stock_problem
from .diffusers_attention import _active_backend, _known_attention
from .diffusers_blocks import _children, _row_norm
from .diffusers_models import KNOWN_FORWARDS, _own_forward_problem, model_call
from .rows import fused_parts, rows_of

KNOWN_FORWARDS["WanTransformer3DModel"] = {"24661a03f570e853": "diffusers 0.42.1"}


# ---------------------------------------------------------------------------------------------------------
# Wan
# ---------------------------------------------------------------------------------------------------------
def _wan_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the rotation WanAttnProcessor applies (interleaved pairs), on [B, rows, H, D] with cos/sin [1, rows, 1, D]
    x1, x2 = t.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(t)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(t)


def _bind_wan(attn, args: tuple, kwargs: dict) -> AttentionCall | str:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    if type(attn.processor) is not WanAttnProcessor:
        return f"processor {type(attn.processor).__name__} is not one streamplan knows"
    if getattr(attn.processor, "_parallel_config", None) is not None:
        return "context parallelism is configured"
    call = call_args(("hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb"), args, kwargs)
    if isinstance(call, str):
        return call
    x, enc, mask, rotary = (call.get(k) for k in ("hidden_states", "encoder_hidden_states", "attention_mask",
                                                  "rotary_emb"))
    if attn.add_k_proj is not None:
        return "image-context (I2V) cross-attention is not handled yet"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    if mask is not None and mask.dim() != 4:
        return "attention_mask is not 4-D"
    B, N, _ = x.shape
    H = attn.heads
    inner = attn.inner_dim
    D = inner // H
    cross = enc is not None
    if attn.fused_projections and cross != bool(attn.is_cross_attention):
        return "fused projections called against the module's cross-attention flag"
    if cross and rotary is not None:
        return "rotary embedding on cross-attention"
    if attn.fused_projections:
        if cross:
            q_proj = attn.to_q
            kv_parts = fused_parts(attn.to_kv, 2)
            if kv_parts is None:
                return "fused to_kv weight cannot be sliced"
        else:
            parts = fused_parts(attn.to_qkv, 3)
            if parts is None:
                return "fused to_qkv weight cannot be sliced"
            q_proj, kv_parts = parts[0], parts[1:]
    else:
        q_proj, kv_parts = attn.to_q, [attn.to_k, attn.to_v]
    k_proj, v_proj = kv_parts

    def rope(t, a, b):
        if rotary is None:
            return t
        return _wan_rotary(t, rows_of(rotary[0], a, b, 1), rows_of(rotary[1], a, b, 1))

    def q(h, a, b):
        return rope(attn.norm_q(q_proj(h)).unflatten(2, (H, -1)), a, b)

    def kv_of(src, a, b):
        k = rope(attn.norm_k(k_proj(src)).unflatten(2, (H, -1)), a, b)
        return k, v_proj(src).unflatten(2, (H, -1))

    def out(o, a, b):
        y = o.flatten(2, 3).to(x.dtype)
        return attn.to_out[1](attn.to_out[0](y))

    seg = Segment(x, q, None if cross else kv_of, out)
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=[seg], finish=lambda outs: outs[0],
                         dtype=x.dtype, mask=mask,
                         kv_whole=(lambda: kv_of(enc, 0, enc.shape[1])) if cross else None)


def recognize_wan_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    known = _known_attention(name, module, "diffusers.models.transformers.transformer_wan", "WanAttention",
                             "WanAttnProcessor")
    if known is None or known[1] is not None:
        return known and known[1]
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if module.add_k_proj is not None:
        return skip("image-context (I2V) cross-attention is not handled yet")
    H = module.heads
    return AttentionSpec(module=module, label="diffusers.WanAttention[WanAttnProcessor]", heads=H, kv_heads=H,
                         head_dim=module.inner_dim // H, dim_out=module.to_out[0].out_features,

                         bind=lambda args, kwargs: _bind_wan(module, args, kwargs),
                         backend=lambda: _active_backend(module.processor))


# --------------------------------------------------------------------------------------------------------- Wan
def _bind_wan_block(block, mlp: MLPRunner, args: tuple, kwargs: dict) -> BlockCall | str:
    call = call_args(("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"), args, kwargs)
    if isinstance(call, str):
        return call
    x, enc, temb, rotary = (call.get(k) for k in ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"))
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not isinstance(temb, torch.Tensor):
        return "hidden_states is not [batch, tokens, dim] or temb is missing"
    att1 = _bind_wan(block.attn1, (x, None, None, rotary), {})
    if isinstance(att1, str):
        return f"attn1: {att1}"
    att2 = _bind_wan(block.attn2, (x, enc, None, None), {})
    if isinstance(att2, str):
        return f"attn2: {att2}"
    from .diffusers_attention import _active_backend
    consumer2 = consumer_for(_active_backend(block.attn2.processor))
    if consumer2 is None:
        return "attn2's attention backend has no streamplan consumer"
    why = unsupported(consumer2, heads=att2.heads, kv_heads=att2.kv_heads, head_dim=att2.head_dim, causal=False,
                      mask=None, dtype=att2.dtype)
    if why:
        return f"attn2: {why}"
    table = block.scale_shift_table
    if temb.dim() == 4:       # per-token modulation [B, N, 6, dim] (Wan2.2 TI2V): computed per chunk only
        def mod(a, b):
            return [m.squeeze(2) for m in (table.unsqueeze(0) + temb[:, a:b].float()).chunk(6, dim=2)]
    else:                     # per-sample modulation [B, 6, dim]
        whole = (table + temb.float()).chunk(6, dim=1)
        mod = lambda a, b: whole  # noqa: E731
    kv2 = []

    def cross_kv():
        if not kv2:
            k, v = att2.kv_whole()
            kv2.extend((k.transpose(1, 2), v.transpose(1, 2)))
        return kv2

    def prefix(r, a, b):
        shift, scale = mod(a, b)[:2]
        return (block.norm1(r.float()) * (1 + scale) + shift).type_as(r)

    def suffix(r, h, y, a, b):
        _, _, gate, c_shift, c_scale, c_gate = mod(a, b)
        r = (r.float() + y * gate).type_as(r)
        n = block.norm2(r.float()).type_as(r)
        k2, v2 = cross_kv()
        r = r + attend_rows(att2, consumer2, k2, v2, att2.segments[0], n, 0, a, b)
        n = (block.norm3(r.float()) * (1 + c_scale) + c_shift).type_as(r)
        return (r.float() + mlp(n).float() * c_gate).type_as(r)

    # Wan's residual and modulation math is fp32: two [rows, dim] fp32 tensors are alive with the MLP's output
    return BlockCall([Stream(x, prefix, suffix)], att1, finish=lambda xs: xs[0], fp32_row_elems=2 * x.shape[-1])


def recognize_wan_block(name: str, module: nn.Module) -> BlockSpec | Skip | None:
    mod = sys.modules.get("diffusers.models.transformers.transformer_wan")
    if mod is None or type(module) is not getattr(mod, "WanTransformerBlock", None):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    problem = stock_problem(module, mod.WanTransformerBlock.forward)
    if problem:
        return skip(problem)
    if not all(_row_norm(getattr(module, n)) for n in ("norm1", "norm2", "norm3")):
        return skip("a norm streamplan does not know")
    found = _children(name, module, ["attn1", "attn2"], ["ffn"], recognize_wan_attention)
    if isinstance(found, str):
        return skip(found)
    (attn1, _), (ffn,) = found
    runner = MLPRunner(ffn)
    return BlockSpec(module, "diffusers.WanTransformerBlock", attn1, [ffn],
                     bind=lambda args, kwargs: _bind_wan_block(module, runner, args, kwargs))


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

    for block in model.blocks:
        with donate(hidden_states):
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

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
    if isinstance(call, str):
        return call
    if torch.is_grad_enabled() and model.gradient_checkpointing:
        return "gradient checkpointing is active"
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
        problem = stock_problem(getattr(module, sub))
        if problem:
            return skip(f"{sub}: {problem}")
    return ModelSpec(module, "diffusers.WanTransformer3DModel[donated blocks, streamed head]",
                     run=lambda args, kwargs, chunk: _wan_forward(module, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _wan_can_stream(module, args, kwargs))
