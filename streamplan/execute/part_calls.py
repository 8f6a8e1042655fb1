"""Handlers for the recognised parts of a block: row-local modules, MLPs and attention modules."""
from __future__ import annotations

import inspect

from typing import Any

import torch

from .context import CallContext
from .call_state import needs_grad, shapes
from ..attention import consumer_for, unsupported
from .attention_run import run_attention
from .mlp_run import run_mlp, run_seq_chunked
from ..specs import AttentionCall, AttentionSpec
from ..plan.planner import UTILISATION_FLOOR, AttentionDims, Tier, plan_attention, plan_mlp, plan_rows


def attention_dims(spec: AttentionSpec, call: AttentionCall, consumer) -> AttentionDims:
    kv_rows = call.keys
    if call.kv_whole is not None:
        kv_rows = 0  # short cross-attention K/V: built whole, small; counted in the chunk transient
    elem = torch.empty((), dtype=call.dtype).element_size()
    return AttentionDims(call.batch, call.rows, kv_rows, call.heads, call.kv_heads, call.head_dim, spec.dim_out,
                         elem, _mask_row_bytes(call) + workspace_row_bytes(consumer, call, elem),
                         built_held=call.built_held, built_transient=call.built_transient,
                         built_inputs=call.built_inputs)


def _mask_row_bytes(call: AttentionCall) -> int:
    """Bytes per query row of a mask the binder prepares chunk by chunk (a broadcast mask costs nothing per row)."""
    m = call.mask
    if call.mask_rows is not None and m is not None and m.shape[-2] != 1:
        return m.numel() // m.shape[-2] * m.element_size()
    return 0


def workspace_row_bytes(consumer, call, elem: int) -> int:
    """What the consumer itself allocates per query row of a chunk, as it declares (0 if it declares nothing)."""
    declare = getattr(consumer, "workspace_row_bytes", None)
    if declare is None:
        return 0
    kw = dict(heads=call.heads, head_dim=call.head_dim, elem=elem, causal=call.causal, masked=call.mask is not None)
    declared = inspect.signature(declare).parameters
    # a consumer whose kernels allocate differently per device, or per key (scores over every key), says so
    for name, value in (("device_type", getattr(call, "device_type", None)), ("keys", getattr(call, "keys", None)),
                        ("batch", getattr(call, "batch", None))):
        if value is not None and name in declared:
            kw[name] = value
    return declare(**kw)


def workspace_bytes(consumer, call, elem: int, rows: int, keys: int) -> int:
    """What the consumer itself allocates for one chunk of ``rows`` query rows against ``keys`` keys, as it declares
    (a whole-call declaration where it makes one, which may not be linear in the rows; else its per-row one)."""
    declare = getattr(consumer, "workspace_bytes", None)
    if declare is None:
        return workspace_row_bytes(consumer, call, elem) * rows
    kw = {"softcap": call.softcap} if getattr(call, "softcap", 0.0) else {}   # said only where there is one
    if getattr(call, "mask", None) == "sinks":   # a sinks chain: merged by the math path's log-sum-exp
        kw["sinks"] = True
    return declare(rows=rows, keys=keys, heads=call.heads, kv_heads=call.kv_heads, head_dim=call.head_dim, elem=elem,
                   causal=call.causal, masked=call.mask is not None, device_type=getattr(call, "device_type", None),
                   **kw)


def run_row_local(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    entry = ctx.entry
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or needs_grad(entry.module, x):
        return entry.stock(*args, **kwargs)
    o = ctx.options
    row_bytes = x.numel() // x.shape[1] * x.element_size()
    plan = ctx.plan((shapes(args, kwargs), x.dtype, x.device.type), lambda budget: plan_rows(
        x.shape[1], row_bytes, entry.spec.transient_per_elem, chunk_tokens=o.chunk_tokens, budget=budget),
        args, kwargs, x.device)
    if plan.tier == Tier.L0:
        return entry.stock(*args, **kwargs)
    return run_seq_chunked(entry.stock, x, plan.chunk, args[1:], kwargs)


def run_mlp_spec(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    entry = ctx.entry
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
        return entry.stock(*args, **kwargs)
    x = args[0]
    if needs_grad(entry.module, x):
        ctx.note("autograd is recording: ran stock (streamed executors are for inference)")
        return entry.stock(x)
    o = ctx.options
    rows = x.numel() // x.shape[-1]
    plan = ctx.plan((tuple(x.shape), x.dtype, x.device.type), lambda budget: plan_mlp(
        entry.spec, rows, x.element_size(), chunk_tokens=o.chunk_tokens, ffn_slice=o.ffn_slice, budget=budget),
        args, kwargs, x.device)
    if plan.tier == Tier.L0:
        return entry.stock(x)
    return run_mlp(entry.spec, plan, entry.stock, x)


def _bind(ctx: CallContext, attn: AttentionSpec, args: tuple, kwargs: dict):
    """(consumer, the call taken apart) when this call can stream, else None after noting why it runs stock."""
    entry = ctx.entry
    consumer = consumer_for(attn.backend())
    if consumer is None:
        ctx.note(f"ran stock: attention backend {attn.backend()!r} has no streamplan consumer")
        return None
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    if tensors and needs_grad(entry.module, tensors[0]):
        ctx.note("autograd is recording: ran stock (streamed executors are for inference)")
        return None
    call = entry.spec.bind(args, kwargs)
    if isinstance(call, str):
        ctx.note(f"ran stock: {call}")
        return None
    why = unsupported(consumer, heads=call.heads, kv_heads=call.kv_heads, head_dim=call.head_dim,
                      causal=call.causal, mask=call.mask, dtype=call.dtype)
    if why:
        ctx.note(f"ran stock: {why}")
        return None
    return consumer, call


def run_attention_spec(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    entry = ctx.entry
    spec: AttentionSpec = entry.spec
    bound = _bind(ctx, spec, args, kwargs)
    if bound is None:
        return entry.stock(*args, **kwargs)
    consumer, call = bound
    o = ctx.options
    device = call.segments[0].source.device
    sig = (shapes(args, kwargs), call.dtype, device.type)
    plan = ctx.plan(sig, lambda budget: plan_attention(
        attention_dims(spec, call, consumer), chunk_tokens=o.chunk_tokens, budget=budget,
        q_align=consumer.caps.q_align,
        head_groups=o.head_groups,
        can_group=call.cache_update is None and call.kv_whole is None and call.kv_frame is None,
        min_chunk=UTILISATION_FLOOR.get(device.type, 0)), args, kwargs, device)
    if plan.tier == Tier.L0:
        return entry.stock(*args, **kwargs)
    return run_attention(call, consumer, plan.chunk, plan.head_groups)
