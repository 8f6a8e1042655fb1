"""Attention consumers: backends declare what they can consume; the planner and executors never name one.

A consumer is looked up by the backend name the model is using (transformers' ``config._attn_implementation``,
diffusers' active attention backend). A backend with no registered consumer gets the stock full-Q call.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from .flex import Q_BLOCK, FlexConsumer
from .sdpa import SDPAConsumer


@dataclass(frozen=True)
class ConsumerCaps:
    bounded_q: bool = True                 # accepts a chunk of Q rows against global K/V
    q_offset: bool = True                  # handles causal masks for a chunk that starts at row q_offset
    gqa: bool = True                       # K/V with fewer heads than Q
    masks: frozenset[str] = frozenset({"bool", "additive"})  # mask forms, given cut to the chunk's rows ("flex":
    # an ``attention.flex.FlexMask`` over the call's global indices, cut by the consumer itself)
    kv_blocks_lse: bool = False            # can attend K/V in blocks and return log-sum-exp
    kv_blocks_last_resort: bool = False    # those blocks run on another kernel than its chunks (a store only below
    # what K/V on the card reach: a plan that fits keeps the kernel the user chose)
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    max_head_dim: int | None = None
    q_align: int = 1                       # chunk starts must be multiples of this
    softcap: bool = False                  # takes ``softcap=c``: scores soft-capped as c * tanh(s / c) (Gemma 2)
    sinks: bool = False                    # takes ``sinks=[H]``: a logit per head in each row's softmax (GPT-OSS)


class AttentionConsumer(Protocol):
    """``attend(q, k, v, ...)``: q [B, H, c, D] (rows q_offset..q_offset+c), k/v [B, Hkv, Nk, D] -> [B, H, c, D]."""

    name: str
    caps: ConsumerCaps

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, causal: bool,
               mask: torch.Tensor | None, scale: float | None) -> torch.Tensor: ...

    # with caps.kv_blocks_lse: one K/V block, its output and fp32 log-sum-exp (host-staged and compressed K/V stores)
    # def attend_lse(self, q, k, v, *, causal, mask, scale) -> tuple[torch.Tensor, torch.Tensor]: ...

    # optional: bytes the consumer allocates per query row of a chunk, for the planner's memory model
    # def workspace_row_bytes(self, *, heads, head_dim, elem, causal, masked) -> int: ...


@dataclass
class _Registry:
    by_backend: dict[str, AttentionConsumer] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_consumer(backend: str, consumer: AttentionConsumer) -> None:
    """Declare that ``consumer`` serves attention for models whose backend is named ``backend``."""
    if not hasattr(consumer, "attend") or not isinstance(getattr(consumer, "caps", None), ConsumerCaps):
        raise ValueError("consumer must have an attend(...) method and a ConsumerCaps in .caps")
    _REGISTRY.by_backend[backend] = consumer


def unregister_consumer(backend: str) -> None:
    _REGISTRY.by_backend.pop(backend, None)


def consumer_for(backend: str) -> AttentionConsumer | None:
    return _REGISTRY.by_backend.get(backend)


# a captured graph's attention is ATen's scaled_dot_product_attention: whoever serves PyTorch SDPA serves it
GRAPH_BACKEND = "sdpa"


_SCOPED: ContextVar[AttentionConsumer | None] = ContextVar("streamplan_graph_consumer", default=None)


def graph_consumer(backend: str | None = None) -> AttentionConsumer | None:
    """The consumer for the attention nodes of captured graphs: the one a host scoped to this call
    (``graph_consumer_scope``), else the one registered for the block's own ``backend`` (None: PyTorch SDPA's)."""
    scoped = _SCOPED.get()
    return scoped if scoped is not None else consumer_for(backend or GRAPH_BACKEND)


@contextmanager
def graph_consumer_scope(consumer: AttentionConsumer) -> Iterator[None]:
    """Within this context captured graphs attend through ``consumer``: a host that knows the attention backend of
    the blocks it calls, per call (ComfyUI: ``optimized_attention`` with that call's transformer_options)."""
    token = _SCOPED.set(consumer)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def unsupported(consumer: AttentionConsumer, *, heads: int, kv_heads: int, head_dim: int, causal: bool,
                mask: torch.Tensor | None, dtype: torch.dtype, whole_q: bool = False,
                softcap: bool = False, sinks: bool = False) -> str | None:
    """Why this consumer cannot take this call in bounded Q chunks (``whole_q``: in one call with every query row),
    or None."""
    caps = consumer.caps
    if not caps.bounded_q and not whole_q:
        return f"attention backend {consumer.name} needs the whole Q"
    if heads != kv_heads and not caps.gqa:
        return f"attention backend {consumer.name} does not take grouped K/V heads"
    if causal and not caps.q_offset:
        return f"attention backend {consumer.name} cannot offset a causal mask"
    if mask is not None and ("bool" if mask.dtype == torch.bool else "additive") not in caps.masks:
        return f"attention backend {consumer.name} does not take this mask form"
    if dtype not in caps.dtypes:
        return f"attention backend {consumer.name} does not take {dtype}"
    if caps.max_head_dim is not None and head_dim > caps.max_head_dim:
        return f"attention backend {consumer.name} does not take head_dim {head_dim}"
    if softcap and not caps.softcap:
        return f"attention backend {consumer.name} does not soft-cap attention scores"
    if sinks and not caps.sinks:
        return f"attention backend {consumer.name} does not take attention sinks"
    return None


def lse_attention(consumer: AttentionConsumer | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``attend(q, k, v, scale=)`` returning the output and its fp32 log-sum-exp, unmasked and not causal (a merge
    of partial attentions needs it): the consumer's own where it has one, else PyTorch SDPA's."""
    source = consumer if consumer is not None and consumer.caps.kv_blocks_lse and hasattr(consumer, "attend_lse") \
        else SDPA
    return functools.partial(source.attend_lse, causal=False, mask=None)


# attend_lse: K/V in blocks, merged by log-sum-exp; softcap: soft-capped scores by its fp32 math, in bounded pieces;
# sinks: the attention's log-sum-exp merged with each head's sink
SDPA = SDPAConsumer(ConsumerCaps(kv_blocks_lse=True, softcap=True, sinks=True))
for _name in ("sdpa", "eager", "native"):   # eager attention is the same math as SDPA's
    register_consumer(_name, SDPA)
# flex: a call with a BlockMask one Q chunk at a time (chunks start on the mask's query blocks); plain SDPA otherwise
FLEX = FlexConsumer(ConsumerCaps(q_align=Q_BLOCK, masks=frozenset({"bool", "additive", "flex"})), SDPA)
register_consumer("flex", FLEX)

__all__ = ["ConsumerCaps", "AttentionConsumer", "register_consumer", "unregister_consumer", "consumer_for",
           "graph_consumer", "graph_consumer_scope",
           "unsupported", "SDPA", "FLEX"]
