"""diffusers attention: ``Attention`` + ``AttnProcessor2_0`` (self, cross, masks), and what the families' attention
recognizers share (backend lookup, head norms; Wan's and Flux's own attention live in their family's file)."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...specs import AttentionCall, AttentionSpec, Segment, Skip
from ...registries import register_backend_probe
from ...recognize.checks import call_args, stock_problem


def _active_backend(processor) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return getattr(backend, "value", str(backend))


_NATIVE = "native"
_EMPTY = (lambda: None).__code__


def _diffusers_backend(block: nn.Module) -> str | None:
    """The first diffusers attention backend other than native that a processor inside ``block`` would use."""
    if "diffusers" not in sys.modules:
        return None
    for m in block.modules():
        processor = getattr(m, "processor", None)
        call = getattr(type(processor), "__call__", None)
        if processor is None or "dispatch_attention_fn" not in getattr(call, "__code__", _EMPTY).co_names:
            continue   # AttnProcessor2_0 and kin call PyTorch's SDPA themselves, whatever the backend
        backend = _active_backend(processor)
        if backend != _NATIVE:
            return backend
    return None


register_backend_probe(_diffusers_backend)


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
            if raw.dim() == 3 and raw.shape[1] == N:
                rows = raw[:, a:b]
            elif raw.dim() == 4 and raw.shape[-2] == N:      # [B, 1 or H, N, S]: a mask over query rows
                rows = raw[..., a:b, :]
            else:
                rows = raw
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
