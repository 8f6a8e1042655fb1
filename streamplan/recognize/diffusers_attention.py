"""diffusers attention: ``Attention`` + ``AttnProcessor2_0``, ``WanAttention`` + ``WanAttnProcessor``,
``FluxAttention`` + ``FluxAttnProcessor`` (joint text+image and single-stream), fused projections included."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..ir import AttentionCall, AttentionSpec, Segment, Skip
from .checks import call_args, stock_problem
from .rows import fused_parts, rows_of


def _active_backend(processor) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return getattr(backend, "value", str(backend))


def _head_norm_ok(norm, head_dim: int) -> bool:
    """Norms applied per head over head_dim (row-local); anything else is not known."""
    if norm is None:
        return True
    shape = getattr(norm, "normalized_shape", None)
    if shape is None:
        shape = getattr(norm, "dim", None)
    if isinstance(shape, int):
        shape = (shape,)
    return shape is not None and tuple(shape) == (head_dim,) and type(norm).__name__ in (
        "LayerNorm", "FP32LayerNorm", "RMSNorm")


def _norm(norm):
    return (lambda t: t) if norm is None else norm


# ---------------------------------------------------------------------------------------------------------
# generic Attention with AttnProcessor2_0
# ---------------------------------------------------------------------------------------------------------
def _bind_attention(attn, args: tuple, kwargs: dict) -> AttentionCall | str:
    from diffusers.models.attention_processor import AttnProcessor2_0
    if type(attn.processor) is not AttnProcessor2_0:
        return f"processor {type(attn.processor).__name__} is not one streamplan knows"
    call = call_args(("hidden_states", "encoder_hidden_states", "attention_mask", "temb"), args, kwargs)
    if isinstance(call, str):
        return call
    x = call["hidden_states"]
    enc = call.get("encoder_hidden_states")
    mask = call.get("attention_mask")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    B, N, _ = x.shape
    H = attn.heads
    inner = attn.to_q.out_features
    D = inner // H
    norm_q, norm_k = _norm(attn.norm_q), _norm(attn.norm_k)
    S = N if enc is None else enc.shape[1]
    mask_rows = None
    if mask is not None:
        # prepared per chunk: diffusers expands the mask over heads, which for a per-query mask would be
        # a [B*H, N, S] copy of the whole sequence
        raw = mask

        def mask_rows(a, b):
            rows = raw[:, a:b] if raw.dim() == 3 and raw.shape[1] == N else raw
            m = attn.prepare_attention_mask(rows, S, B)
            return m.view(B, H, -1, m.shape[-1])

        mask = mask_rows(0, min(2, N))  # a sample chunk: form, dtype and per-row size for the plan and consumer

    def q(h, a, b):  # per-head norms act on head_dim alone, so the [B, rows, H, D] layout is fine
        return norm_q(attn.to_q(h).view(B, b - a, H, D))

    def kv_of(src):
        k = attn.to_k(src).view(B, src.shape[1], H, D)
        return norm_k(k), attn.to_v(src).view(B, src.shape[1], H, D)

    def out(o, a, b):
        y = o.reshape(B, b - a, H * D).to(x.dtype)
        y = attn.to_out[1](attn.to_out[0](y))
        if attn.residual_connection:
            y = y + x[:, a:b]
        return y / attn.rescale_output_factor

    kv_whole = None
    if enc is not None:
        src = attn.norm_encoder_hidden_states(enc) if attn.norm_cross else enc
        kv_whole = lambda: kv_of(src)  # noqa: E731
    seg = Segment(x, q, None if enc is not None else (lambda h, a, b: kv_of(h)), out)
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=[seg], finish=lambda outs: outs[0],
                         dtype=x.dtype, mask=mask, mask_rows=mask_rows, kv_whole=kv_whole)


def recognize_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    if "diffusers" not in sys.modules:
        return None
    from diffusers.models.attention_processor import Attention
    if type(module) is not Attention:
        return None
    from diffusers.models.attention_processor import AttnProcessor2_0
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    problem = stock_problem(module, Attention.forward)
    if problem:
        return skip(problem)
    if type(module.processor) is not AttnProcessor2_0:
        return skip(f"processor {type(module.processor).__name__} is not one streamplan knows")
    if module.spatial_norm is not None or module.group_norm is not None:
        return skip("spatial/group norm mixes rows")
    heads = module.heads
    inner = module.to_q.out_features
    if module.to_k.out_features != inner or inner % heads:
        return skip("K width differs from Q width")
    D = inner // heads
    if not (_head_norm_ok(module.norm_q, D) and _head_norm_ok(module.norm_k, D)):
        return skip("Q/K norm is not a per-head norm streamplan knows")
    if module.to_out is None or len(module.to_out) < 2 or not isinstance(module.to_out[1], nn.Dropout):
        return skip("to_out is not [linear, dropout]")
    return AttentionSpec(module=module, label="diffusers.Attention[AttnProcessor2_0]", heads=heads, kv_heads=heads,
                         head_dim=D, dim_out=module.to_out[0].out_features,
                         bind=lambda args, kwargs: _bind_attention(module, args, kwargs),
                         backend=lambda: "native")


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


def _known_attention(name: str, module: nn.Module, module_path: str, cls: str, processor: str):
    """(the library module, None) for an untouched ``cls`` running ``processor``; (None, Skip) when it is that class
    but not safe; None when it is not that class."""
    mod = sys.modules.get(module_path)
    if mod is None or type(module) is not getattr(mod, cls, None):
        return None
    problem = stock_problem(module, getattr(mod, cls).forward)
    if problem is None and type(module.processor) is not getattr(mod, processor):
        problem = f"processor {type(module.processor).__name__} is not one streamplan knows"
    return (None, Skip(name, type(module).__name__, problem)) if problem else (mod, None)


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
