"""Streamed attention: K/V for the whole sequence built chunk by chunk, then Q chunk by chunk."""
from __future__ import annotations

import torch

from ..specs import AttentionCall
from .chunk_loop import for_chunks


def build_kv(call: AttentionCall, chunk: int,
             heads: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, Nk, Hkv, D] (or only K/V heads ``heads`` = (g0, g1)), written chunk by chunk into
    whole-sequence buffers."""
    if call.kv_whole is not None:
        return call.kv_whole()
    g0, g1 = heads or (0, call.kv_heads)
    shape = (call.batch, call.keys, g1 - g0, call.head_dim)
    make = torch.Tensor.new_empty if call.kv_frame is None else torch.Tensor.new_zeros   # a frame: padding is zeros
    buffers: list[torch.Tensor] = []
    start = call.kv_frame.rows_at if call.kv_frame is not None else 0
    for seg in call.segments:
        def work(a: int, b: int, seg=seg, start=start) -> None:
            k, v = seg.kv(seg.source[:, a:b], a, b)
            if not buffers:
                buffers.extend((make(k, shape), make(v, shape)))
            buffers[0][:, start + a:start + b] = k[:, :, g0:g1]
            buffers[1][:, start + a:start + b] = v[:, :, g0:g1]

        for_chunks(seg.rows, chunk, work)
        start += seg.rows
    if call.kv_frame is not None:   # the keys that are not the call's rows
        call.kv_frame.fill(buffers[0], buffers[1])
    return buffers[0], buffers[1]


def global_kv(call: AttentionCall, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase KV: K and V for every row as [B, Hkv, Nk, D] (views), through the cache when the call has one."""
    k_all, v_all = build_kv(call, chunk)
    k, v = k_all.transpose(1, 2), v_all.transpose(1, 2)
    if call.cache_update is not None:
        k, v = call.cache_update(k, v)
    return k, v


def _mask(call: AttentionCall, a: int, b: int, h0: int = 0, h1: int | None = None) -> torch.Tensor | None:
    """The mask of joint query rows [a:b) (and heads [h0:h1) where it has a head dimension)."""
    if call.mask_rows is not None:
        m = call.mask_rows(a, b)
    else:
        m = call.mask
        if m is not None and m.shape[-2] != 1:
            m = m[..., a:b, :]
    if m is not None and h1 is not None and m.dim() == 4 and m.shape[1] != 1:
        m = m[:, h0:h1]
    return m


def attend_rows(call: AttentionCall, consumer, k, v, seg, h: torch.Tensor, start: int, a: int, b: int):
    """Phase Q for rows [a:b) of one segment (starting at joint row ``start``): Q, attention, output projection."""
    q = seg.q(h, a, b).transpose(1, 2)                          # [B, H, c, D]
    o = consumer.attend(q, k, v, q_offset=start + a, causal=call.causal, mask=_mask(call, start + a, start + b),
                        scale=call.scale)
    del q
    return seg.out(o.transpose(1, 2), a, b)


def head_grouped_outputs(call: AttentionCall, consumer, chunk: int, groups: int) -> list[torch.Tensor]:
    """Tier L3: the attention output of every row, [B, rows, H, D] per segment, built one group of heads at a time, so
    only that group's K and V exist. Each chunk's projections are computed whole and cut to the group's heads (norms
    that span heads stay exact), once per group."""
    H, Hkv, D = call.heads, call.kv_heads, call.head_dim
    per_kv = Hkv // groups
    rep = H // Hkv
    outs = [None] * len(call.segments)
    for g in range(groups):
        g0, g1 = g * per_kv, (g + 1) * per_kv
        h0, h1 = g0 * rep, g1 * rep
        k_g, v_g = (t.transpose(1, 2) for t in build_kv(call, chunk, (g0, g1)))
        start = 0
        for i, seg in enumerate(call.segments):
            def q_work(a: int, b: int, i=i, seg=seg, start=start) -> None:
                q = seg.q(seg.source[:, a:b], a, b)[:, :, h0:h1].transpose(1, 2)
                o = consumer.attend(q, k_g, v_g, q_offset=start + a, causal=call.causal,  # noqa: F821 (del after)
                                    mask=_mask(call, start + a, start + b, h0, h1), scale=call.scale)
                if outs[i] is None:
                    outs[i] = o.new_empty((call.batch, seg.rows, H, D))
                outs[i][:, a:b, h0:h1] = o.transpose(1, 2)

            for_chunks(seg.rows, chunk, q_work)
            start += seg.rows
        del k_g, v_g
    return outs


def run_attention(call: AttentionCall, consumer, chunk: int, head_groups: int = 1):
    if head_groups > 1:
        grouped = head_grouped_outputs(call, consumer, chunk, head_groups)
    else:
        k, v = global_kv(call, chunk)
    outputs = []
    start = 0
    for i, seg in enumerate(call.segments):
        buf: list[torch.Tensor] = []

        def work(a: int, b: int, i=i, seg=seg, start=start) -> None:
            if head_groups > 1:
                y = seg.out(grouped[i][:, a:b], a, b)
            else:
                y = attend_rows(call, consumer, k, v, seg, seg.source[:, a:b], start, a, b)
            if not buf:
                buf.append(y.new_empty((call.batch, seg.rows, y.shape[-1])))
            buf[0][:, a:b] = y

        for_chunks(seg.rows, chunk, work)
        outputs.append(buf[0])
        start += seg.rows
    return call.finish(outputs)
