"""Streamed attention: K/V for the whole sequence built chunk by chunk, then Q chunk by chunk."""
from __future__ import annotations

import torch

from ..ir import AttentionCall


def _chunks(rows: int, chunk: int):
    for a in range(0, rows, chunk):
        yield a, min(a + chunk, rows)


def build_kv(call: AttentionCall, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, Nk, Hkv, D], written chunk by chunk into whole-sequence buffers."""
    if call.kv_whole is not None:
        return call.kv_whole()
    k_all = v_all = None
    start = 0
    for seg in call.segments:
        for a, b in _chunks(seg.rows, chunk):
            k, v = seg.kv(a, b)
            if k_all is None:
                shape = (call.batch, call.rows, call.kv_heads, call.head_dim)
                k_all, v_all = k.new_empty(shape), v.new_empty(shape)
            k_all[:, start + a:start + b] = k
            v_all[:, start + a:start + b] = v
            del k, v
        start += seg.rows
    return k_all, v_all


def run_attention(call: AttentionCall, consumer, chunk: int):
    k_all, v_all = build_kv(call, chunk)
    k, v = k_all.transpose(1, 2), v_all.transpose(1, 2)       # [B, Hkv, Nk, D] views
    del k_all, v_all
    if call.cache_update is not None:
        k, v = call.cache_update(k, v)
    mask = call.mask
    outputs = []
    start = 0
    for seg in call.segments:
        buf = None
        for a, b in _chunks(seg.rows, chunk):
            q = seg.q(a, b).transpose(1, 2)                     # [B, H, c, D]
            m = None
            if mask is not None:
                m = mask if mask.shape[-2] == 1 else mask[..., start + a:start + b, :]
            o = consumer.attend(q, k, v, q_offset=start + a, causal=call.causal, mask=m, scale=call.scale)
            del q
            y = seg.out(o.transpose(1, 2), a, b)
            del o
            if buf is None:
                buf = y.new_empty((call.batch, seg.rows, y.shape[-1]))
            buf[:, a:b] = y
            del y
        outputs.append(buf)
        start += seg.rows
    return call.finish(outputs)
