"""Streamed attention: K/V for the whole sequence built chunk by chunk, then Q chunk by chunk."""
from __future__ import annotations

import torch

from ..ir import AttentionCall
from .chunks import for_chunks


def _source_rows(i: int, seg, a: int, b: int) -> torch.Tensor:
    return seg.source[:, a:b]


def build_kv(call: AttentionCall, chunk: int, rows_of=_source_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, Nk, Hkv, D], written chunk by chunk into whole-sequence buffers.

    ``rows_of(i, segment, a, b)`` gives the attention input rows of segment i (a streamed block passes its prefix).
    """
    if call.kv_whole is not None:
        return call.kv_whole()
    shape = (call.batch, call.rows, call.kv_heads, call.head_dim)
    buffers: list[torch.Tensor] = []
    start = 0
    for i, seg in enumerate(call.segments):
        def work(a: int, b: int, i=i, seg=seg, start=start) -> None:
            k, v = seg.kv(rows_of(i, seg, a, b), a, b)
            if not buffers:
                buffers.extend((k.new_empty(shape), v.new_empty(shape)))
            buffers[0][:, start + a:start + b] = k
            buffers[1][:, start + a:start + b] = v

        for_chunks(seg.rows, chunk, work)
        start += seg.rows
    return buffers[0], buffers[1]


def global_kv(call: AttentionCall, chunk: int, rows_of=_source_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase KV: K and V for every row as [B, Hkv, Nk, D] (views), through the cache when the call has one."""
    k_all, v_all = build_kv(call, chunk, rows_of)
    k, v = k_all.transpose(1, 2), v_all.transpose(1, 2)
    if call.cache_update is not None:
        k, v = call.cache_update(k, v)
    return k, v


def attend_rows(call: AttentionCall, consumer, k, v, seg, h: torch.Tensor, start: int, a: int, b: int):
    """Phase Q for rows [a:b) of one segment (starting at joint row ``start``): Q, attention, output projection."""
    q = seg.q(h, a, b).transpose(1, 2)                          # [B, H, c, D]
    if call.mask_rows is not None:
        m = call.mask_rows(start + a, start + b)
    else:
        m = call.mask
        if m is not None and m.shape[-2] != 1:
            m = m[..., start + a:start + b, :]
    o = consumer.attend(q, k, v, q_offset=start + a, causal=call.causal, mask=m, scale=call.scale)
    del q
    return seg.out(o.transpose(1, 2), a, b)


def run_attention(call: AttentionCall, consumer, chunk: int):
    k, v = global_kv(call, chunk)
    outputs = []
    start = 0
    for seg in call.segments:
        buf: list[torch.Tensor] = []

        def work(a: int, b: int, seg=seg, start=start) -> None:
            y = attend_rows(call, consumer, k, v, seg, seg.source[:, a:b], start, a, b)
            if not buf:
                buf.append(y.new_empty((call.batch, seg.rows, y.shape[-1])))
            buf[0][:, a:b] = y

        for_chunks(seg.rows, chunk, work)
        outputs.append(buf[0])
        start += seg.rows
    return call.finish(outputs)
