"""diffusers causal attention that reads a KV cache and pads its sequence to whole 128-row blocks with zero rows
(AnyFlow FAR's ``AnyFlowCausalAttnProcessor`` on its cache-read step), streamed as an attention part through the flex
consumer.

On that step the processor joins the cached keys and values of the earlier chunks (compressed, then full-resolution
tokens) in front of the call's rows, applies rotary to the joined keys (and to the rows' queries), appends as many zero
rows to Q, K and V as pad the *query* length to a multiple of 128, and attends without a mask: the zero keys score 0
and take part in every row's softmax. A captured block cannot take it (the keys' rotary table is longer than the rows
by the cache's length), so the module is taken apart here: Q, K and V of a chunk's rows by the module's own layers and
norms, rotary by the processor's own function on those rows' entries of its tables, and K/V in the processor's layout
(``specs.KVFrame``): the cache's keys (their rotary as the processor applies it) and values first, the rows after them,
the zero rows last. Each Q chunk then attends every key through flex attention with no block mask, as the processor's
call does. Heads narrower than 16 are zero-padded with the processor's scale, as it does. Follows diffusers 0.42.1's
processor, checked by the source fingerprints below.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.flex import FlexMask
from .followed import followed_spec, processor_call, unfollowed
from ...specs import AttentionCall, AttentionSpec, KVFrame, Segment, Skip

_MODULE = "diffusers.models.transformers.transformer_anyflow_far"
# source fingerprints (checks.source_fingerprint) of what the binder follows, as in diffusers 0.42.1
FOLLOWED = {"AnyFlowCausalAttnProcessor.__call__": "49db91d09140225f", "apply_rotary_emb": "4cc3afd0fd745764",
            "AnyFlowAttention.forward": "d3b143efe197c850"}
_ARGS = ("hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb", "kv_cache", "kv_cache_flag")
_PAD_TO = 128      # the processor pads the query length to a multiple of this
_MIN_HEAD = 16     # and narrower heads to this width (flex attention's minimum)


def _sources(mod) -> dict:
    """The sources the binder follows, by the names ``FOLLOWED`` records them under."""
    return {"AnyFlowCausalAttnProcessor.__call__": mod.AnyFlowCausalAttnProcessor.__call__,
             "apply_rotary_emb": mod.apply_rotary_emb, "AnyFlowAttention.forward": mod.AnyFlowAttention.forward}


def _cached(x: torch.Tensor, heads: int, head_dim: int, cache, flag) -> tuple[list[torch.Tensor], int] | str:
    """The cache's parts the processor joins in front of the rows ([2, B, H, n, D] views: compressed, then full) and
    their token count, or why they are not the read step's cache the binder follows."""
    if cache is None:
        return [], 0
    if not isinstance(flag, dict) or flag.get("is_cache_step") is not False:
        return "kv_cache_flag is not a read step's (is_cache_step=True fills the KV cache: stock)"
    parts = []
    for name, count in (("compressed_cache", "num_cached_compressed_tokens"), ("full_cache", "num_cached_full_tokens")):
        t, n = cache.get(name) if isinstance(cache, dict) else None, flag.get(count)
        if not isinstance(n, int) or n < 0:
            return f"kv_cache_flag[{count!r}] is not a token count"
        if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[0] != 2 or t.shape[3] < n or \
                tuple(t.shape[1:3]) != (x.shape[0], heads) or t.shape[4] != head_dim:
            return f"kv_cache[{name!r}] is not a [2, batch, heads, >= {n}, head_dim] tensor"
        if t.dtype != x.dtype or t.device != x.device:
            return f"kv_cache[{name!r}] is {t.dtype} on {t.device}, its rows {x.dtype} on {x.device}"
        parts.append(t[:, :, :, :n])
    return parts, sum(p.shape[3] for p in parts)


def _tables(rotary, batch: int, heads: int, head_dim: int, rows: int, cached: int) -> tuple | str:
    """The rotary tables of the queries (one per row) and the keys (the cache's, then the rows'), or why not."""
    if rotary is None:
        return None, None
    if not isinstance(rotary, dict) or set(rotary) != {"query", "key"}:
        return "rotary_emb is not {'query': table, 'key': table}"
    for name, length in (("query", rows), ("key", cached + rows)):
        t = rotary[name]
        if not isinstance(t, torch.Tensor) or not t.is_complex() or t.dim() != 4 or t.shape[2] != length or \
                t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads) or t.shape[3] != head_dim // 2:
            return (f"rotary_emb[{name!r}] is not a [1|batch, 1|heads, {length}, head_dim/2] complex table (one entry "
                    f"per {'row' if name == 'query' else 'cached token and row'})")
    return rotary["query"], rotary["key"]


def _bind_anyflow_far(attn, mod, args: tuple, kwargs: dict) -> AttentionCall | str:
    proc = attn.processor
    if proc._attention_backend not in mod.AnyFlowCausalAttnProcessor._SUPPORTED_BACKENDS:
        return f"its processor's backend is {proc._attention_backend!r}, not flex (the processor refuses it)"
    call = processor_call(_ARGS, proc, args, kwargs)
    if isinstance(call, str):
        return call
    if call.get("encoder_hidden_states") is not None:
        return "keys from encoder_hidden_states (the binder follows the self-attention)"
    if call.get("attention_mask") is not None:
        return (f"its attention mask is a {type(call['attention_mask']).__name__} (the binder follows the maskless "
                "call of the cache-read step)")
    x = call.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    B, N, _ = x.shape
    H = attn.heads
    D = attn.to_q.out_features // H
    cache = _cached(x, H, D, call.get("kv_cache"), call.get("kv_cache_flag"))
    if isinstance(cache, str):
        return cache
    parts, C = cache
    tables = _tables(call.get("rotary_emb"), B, H, D, N, C)
    if isinstance(tables, str):
        return tables
    rot_q, rot_k = tables
    zeros = math.ceil(N / _PAD_TO) * _PAD_TO - N          # zero rows after the keys: the padding of the query length
    head_pad = max(0, _MIN_HEAD - D)
    scale = 1.0 / (D ** 0.5) if head_pad > 0 else None

    def heads(t: torch.Tensor) -> torch.Tensor:           # [B, c, H*D] -> [B, H, c, D], the processor's layout
        return t.unflatten(2, (H, -1)).transpose(1, 2)

    def rotated(t: torch.Tensor, table, a: int, b: int) -> torch.Tensor:
        return t if table is None else mod.apply_rotary_emb(t, table[:, :, a:b])

    def laid_out(t: torch.Tensor) -> torch.Tensor:        # [B, H, c, D] -> [B, c, H, D + head pad]
        return (F.pad(t, (0, head_pad)) if head_pad else t).transpose(1, 2)

    def normed(proj, norm, h):
        t = proj(h)
        return (norm(t) if norm is not None else t).to(x.dtype)

    def q(h, a, b):
        return laid_out(rotated(heads(normed(attn.to_q, attn.norm_q, h)), rot_q, a, b))

    def kv(h, a, b):
        key = rotated(heads(normed(attn.to_k, attn.norm_k, h)), rot_k, C + a, C + b)
        return laid_out(key), laid_out(heads(attn.to_v(h)))

    def fill(k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """The cache's keys (rotary as the processor applies it to the joined keys) and values, in front of the rows;
        the zero rows after them are the frame's zeros."""
        if not C:
            return
        key = torch.cat([p[0] for p in parts], dim=2)
        value = torch.cat([p[1] for p in parts], dim=2)
        k_buf[:, :C] = laid_out(rotated(key, rot_k, 0, C))
        v_buf[:, :C] = laid_out(value)

    def out(o, a, b):
        o = o[..., :D] if head_pad else o
        y = attn.to_out[0](o.flatten(2, 3).to(x.dtype))
        return attn.to_out[1](y)

    everything = FlexMask(None)
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D + head_pad, segments=[Segment(x, q, kv, out)],
                         finish=lambda outs: outs[0], dtype=x.dtype, scale=scale,
                         mask_rows=lambda a, b: everything, kv_frame=KVFrame(C + N + zeros, fill, rows_at=C))


def recognize_anyflow_far_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    """AnyFlow FAR's causal self-attention (``AnyFlowAttention`` with its ``AnyFlowCausalAttnProcessor``); None for
    anything else (its cross-attention included)."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(module) is not getattr(mod, "AnyFlowAttention", None):
        return None
    processor = type(getattr(module, "processor", None))
    if processor is mod.AnyFlowCrossAttnProcessor:
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if processor is not mod.AnyFlowCausalAttnProcessor:
        return skip(f"its processor is {processor.__name__}, not the AnyFlowCausalAttnProcessor streamplan follows")
    problem = unfollowed(module, mod.AnyFlowAttention.forward, _sources(mod), FOLLOWED)
    if problem:
        return skip(problem)
    return followed_spec(module, "diffusers AnyFlowAttention[flex, KV cache + zero padding]", module.heads,
                         module.to_q.out_features, module.to_out[0],
                         lambda args, kwargs: _bind_anyflow_far(module, mod, args, kwargs), "flex")
