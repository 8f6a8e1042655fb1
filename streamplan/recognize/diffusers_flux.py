"""Flux (diffusers ``FluxAttention``, ``FluxTransformerBlock``, ``FluxSingleTransformerBlock``): the joint text+image
attention and both blocks streamed whole, in one place."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..executors.mlp import MLPRunner
from ..ir import AttentionCall, AttentionSpec, BlockCall, BlockSpec, Segment, Skip, Stream
from .checks import call_args, stock_problem
from .diffusers_attention import _active_backend, _known_attention
from .diffusers_blocks import _children, _fp16_clip, _row_norm
from .rows import fused_parts


# ---------------------------------------------------------------------------------------------------------
# Flux
# ---------------------------------------------------------------------------------------------------------
def flux_attention_call(attn, sources: list[tuple[torch.Tensor, str]], rotary, mask, project_out: bool,
                        dtype: torch.dtype) -> AttentionCall | str:
    """Segments over the joint sequence of ``sources`` in order: "txt" rows use the added projections, norms and
    ``to_add_out``; "img" rows the main ones and ``to_out`` (or the raw attention output when not projected)."""
    from diffusers.models.embeddings import apply_rotary_emb
    D = attn.head_dim
    if rotary is not None and not (isinstance(rotary, (tuple, list)) and len(rotary) == 2):
        return "rotary embedding is not a (cos, sin) pair"
    if mask is not None and mask.dim() != 4:
        return "attention_mask is not 4-D"

    def projections(fused_name: str, names: tuple[str, str, str]):
        if attn.fused_projections:
            return fused_parts(getattr(attn, fused_name), 3)
        return [getattr(attn, n) for n in names]

    def rope(t, a, b):  # a, b: joint rows
        if rotary is None:
            return t
        return apply_rotary_emb(t, (rotary[0][a:b], rotary[1][a:b]), sequence_dim=1)

    def segment(src, projs, norm_q, norm_k, offset, out):
        qp, kp, vp = projs

        def q(h, a, b):
            return rope(norm_q(qp(h).unflatten(-1, (-1, D))), offset + a, offset + b)

        def kv(h, a, b):
            k = rope(norm_k(kp(h).unflatten(-1, (-1, D))), offset + a, offset + b)
            return k, vp(h).unflatten(-1, (-1, D))

        return Segment(src, q, kv, out)

    def img_out(o, a, b):
        y = o.flatten(2, 3).to(dtype)
        return attn.to_out[1](attn.to_out[0](y)) if project_out else y

    def txt_out(o, a, b):
        return attn.to_add_out(o.flatten(2, 3).to(dtype))

    segments, offset = [], 0
    for src, kind in sources:
        if kind == "txt":
            projs = projections("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
            if projs is None:
                return "fused to_added_qkv weight cannot be sliced"
            segments.append(segment(src, projs, attn.norm_added_q, attn.norm_added_k, offset, txt_out))
        else:
            projs = projections("to_qkv", ("to_q", "to_k", "to_v"))
            if projs is None:
                return "fused to_qkv weight cannot be sliced"
            segments.append(segment(src, projs, attn.norm_q, attn.norm_k, offset, img_out))
        offset += src.shape[1]
    first = sources[0][0]
    H = _flux_heads(attn)
    return AttentionCall(batch=first.shape[0], heads=H, kv_heads=H, head_dim=D, segments=segments,
                         finish=lambda outs: outs[0], dtype=dtype, mask=mask)


def _flux_heads(attn) -> int:
    width = attn.to_qkv.out_features // 3 if attn.fused_projections else attn.to_q.out_features
    return width // attn.head_dim


def flux_processor_problem(attn) -> str | None:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    if type(attn.processor) is not FluxAttnProcessor:
        return f"processor {type(attn.processor).__name__} is not one streamplan knows"
    if getattr(attn.processor, "_parallel_config", None) is not None:
        return "context parallelism is configured"
    return None


def _bind_flux(attn, args: tuple, kwargs: dict) -> AttentionCall | str:
    problem = flux_processor_problem(attn)
    if problem:
        return problem
    call = call_args(("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb"), args,
                      kwargs)
    if isinstance(call, str):
        return call
    x, enc, mask, rotary = (call.get(k) for k in ("hidden_states", "encoder_hidden_states", "attention_mask",
                                                  "image_rotary_emb"))
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    if enc is not None and attn.added_kv_proj_dim is None:
        return "encoder_hidden_states without added projections"
    sources = [(enc, "txt"), (x, "img")] if enc is not None else [(x, "img")]
    result = flux_attention_call(attn, sources, rotary, mask, project_out=enc is not None, dtype=x.dtype)
    if isinstance(result, AttentionCall) and enc is not None:
        result.finish = lambda outs: (outs[1], outs[0])
    return result


def recognize_flux_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    known = _known_attention(name, module, "diffusers.models.transformers.transformer_flux", "FluxAttention",
                             "FluxAttnProcessor")
    if known is None or known[1] is not None:
        return known and known[1]
    D = module.head_dim
    return AttentionSpec(module=module, label="diffusers.FluxAttention[FluxAttnProcessor]", heads=module.heads,
                         kv_heads=module.heads, head_dim=D, dim_out=module.out_dim,
                         bind=lambda args, kwargs: _bind_flux(module, args, kwargs),
                         backend=lambda: _active_backend(module.processor))


# -------------------------------------------------------------------------------------------------------- Flux
_FLUX_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")


def _flux_call(block, args: tuple, kwargs: dict, kinds: tuple[str, str], project_out: bool):
    """(image rows, text rows, temb, the joint attention over [text, image]) of a Flux block call, or why not."""
    call = call_args(_FLUX_ARGS, args, kwargs)
    if isinstance(call, str):
        return call
    if call.get("joint_attention_kwargs"):
        return "joint_attention_kwargs are given"
    x, enc, temb = call.get("hidden_states"), call.get("encoder_hidden_states"), call.get("temb")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (x, enc)) or temb is None:
        return "hidden_states/encoder_hidden_states are not [batch, tokens, dim] or temb is missing"
    problem = flux_processor_problem(block.attn)
    if problem:
        return problem
    att = flux_attention_call(block.attn, [(enc, kinds[0]), (x, kinds[1])], call.get("image_rotary_emb"), None,
                              project_out=project_out, dtype=x.dtype)
    return att if isinstance(att, str) else (x, enc, temb, att)


def _bind_flux_block(block, ff: MLPRunner, ff_ctx: MLPRunner, args: tuple, kwargs: dict) -> BlockCall | str:
    parsed = _flux_call(block, args, kwargs, ("txt", "img"), project_out=True)
    if isinstance(parsed, str):
        return parsed
    x, enc, temb, att = parsed
    # the modulation depends on temb alone: take it from one row
    _, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(x[:, :1], emb=temb)
    _, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(enc[:, :1], emb=temb)

    def img_suffix(r, h, y, a, b):
        r = r + gate_msa.unsqueeze(1) * y
        n = block.norm2(r) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return r + gate_mlp.unsqueeze(1) * ff(n)

    def txt_suffix(r, h, y, a, b):
        r = r + c_gate_msa.unsqueeze(1) * y
        n = block.norm2_context(r) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        return _fp16_clip(r + c_gate_mlp.unsqueeze(1) * ff_ctx(n))

    streams = [Stream(enc, lambda r, a, b: block.norm1_context(r, emb=temb)[0], txt_suffix),
               Stream(x, lambda r, a, b: block.norm1(r, emb=temb)[0], img_suffix)]
    return BlockCall(streams, att, finish=lambda xs: (xs[0], xs[1]))


def _bind_flux_single(block, args: tuple, kwargs: dict) -> BlockCall | str:
    # the joint sequence [text, image] is never concatenated: two streams share the same projections
    parsed = _flux_call(block, args, kwargs, ("img", "img"), project_out=False)
    if isinstance(parsed, str):
        return parsed
    x, enc, temb, att = parsed
    gate = block.norm(x[:, :1], emb=temb)[1].unsqueeze(1)

    def prefix(r, a, b):
        return block.norm(r, emb=temb)[0]

    def suffix(r, h, y, a, b):
        mlp = block.act_mlp(block.proj_mlp(h))
        return _fp16_clip(r + gate * block.proj_out(torch.cat([y, mlp], dim=2)))

    return BlockCall([Stream(enc, prefix, suffix), Stream(x, prefix, suffix)], att,
                     finish=lambda xs: (xs[0], xs[1]), mlp_rows_elems=2 * block.proj_mlp.out_features,
                     # stock concatenates [text, image], keeps the MLP branch alive across attention, then
                     # concatenates [attention, mlp] for proj_out
                     stock_rows_elems=2 * block.proj_mlp.out_features + 6 * x.shape[-1])


def _ada_norm_ok(norm: nn.Module, cls_name: str) -> bool:
    mod = sys.modules.get("diffusers.models.normalization")
    cls = getattr(mod, cls_name, None)
    return (type(norm) is cls and getattr(norm, "emb", None) is None and isinstance(norm.norm, nn.LayerNorm)
            and "forward" not in norm.__dict__)


def recognize_flux_block(name: str, module: nn.Module) -> BlockSpec | Skip | None:
    mod = sys.modules.get("diffusers.models.transformers.transformer_flux")
    if mod is None or type(module) not in (getattr(mod, "FluxTransformerBlock", None),
                                           getattr(mod, "FluxSingleTransformerBlock", None)):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    problem = stock_problem(module, type(module).forward)
    if problem:
        return skip(problem)
    if type(module) is mod.FluxTransformerBlock:
        if not (_ada_norm_ok(module.norm1, "AdaLayerNormZero")
                and _ada_norm_ok(module.norm1_context, "AdaLayerNormZero")
                and _row_norm(module.norm2) and _row_norm(module.norm2_context)):
            return skip("a norm streamplan does not know")
        found = _children(name, module, ["attn"], ["ff", "ff_context"], recognize_flux_attention)
        if isinstance(found, str):
            return skip(found)
        (attn,), (ff, ff_ctx) = found
        runners = [MLPRunner(ff), MLPRunner(ff_ctx)]
        return BlockSpec(module, "diffusers.FluxTransformerBlock", attn, [ff, ff_ctx],
                         bind=lambda args, kwargs: _bind_flux_block(module, *runners, args, kwargs))
    if not _ada_norm_ok(module.norm, "AdaLayerNormZeroSingle"):
        return skip("a norm streamplan does not know")
    if type(module.proj_mlp) is not nn.Linear or type(module.act_mlp) is not nn.GELU:
        return skip("MLP branch is not Linear + GELU")
    found = _children(name, module, ["attn"], [], recognize_flux_attention)
    if isinstance(found, str):
        return skip(found)
    (attn,), _ = found
    return BlockSpec(module, "diffusers.FluxSingleTransformerBlock", attn, [],
                     bind=lambda args, kwargs: _bind_flux_single(module, args, kwargs))
