"""diffusers blocks streamed whole: ``WanTransformerBlock``, ``FluxTransformerBlock``, ``FluxSingleTransformerBlock``.

Each binder takes one call apart into per-stream prefix (norm, modulation) and suffix (gate, residual, and the
row-local rest: cross-attention to text, the MLP), calling the block's own submodules on row chunks.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..consumers import consumer_for, unsupported
from ..executors.attention import attend_rows
from ..executors.mlp import MLPRunner
from ..ir import AttentionSpec, BlockCall, BlockSpec, MLPSpec, Skip, Stream
from .checks import stock_problem
from .checks import call_args
from .diffusers_attention import (_bind_wan, flux_attention_call, flux_processor_problem,
                                  recognize_flux_attention, recognize_wan_attention)
from .diffusers_mlp import recognize_feedforward


def _children(name: str, module: nn.Module, attn_names: list[str], mlp_names: list[str], recognize_attn):
    """The block's attention and MLP specs, or the reason the block cannot be streamed whole."""
    attns, mlps = [], []
    for n in attn_names:
        spec = recognize_attn(f"{name}.{n}", getattr(module, n))
        if not isinstance(spec, AttentionSpec):
            return f"{n}: {spec.reason if isinstance(spec, Skip) else 'not recognised'}"
        attns.append(spec)
    for n in mlp_names:
        spec = recognize_feedforward(f"{name}.{n}", getattr(module, n))
        if not isinstance(spec, MLPSpec):
            return f"{n}: {spec.reason if isinstance(spec, Skip) else 'not recognised'}"
        mlps.append(spec)
    return attns, mlps


def _row_norm(norm: nn.Module) -> bool:
    known = ("FP32LayerNorm", "LayerNorm", "Identity", "RMSNorm")
    return type(norm).__name__ in known and "forward" not in norm.__dict__


def _fp16_clip(t: torch.Tensor) -> torch.Tensor:
    return t.clip(-65504, 65504) if t.dtype == torch.float16 else t


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
