"""A captured block's global attention, one Q chunk at a time, through its consumer. Where the model forward described
the block's mask instead of building it (``specs.RowMask``), each chunk's mask rows are built here against the keys
they can see, so no mask over rows x rows ever exists; a described flex mask goes to the flex consumer, which cuts its
block tables to the chunk."""
from __future__ import annotations

import weakref

import torch

from ..specs import RowMask


class ChunkAttention:
    """``attend(q, k, v, *, q_offset, causal, scale, mask, softcap)`` for the graph run: the consumer's own call, or
    with a row mask the chunk's rows of it (a window's range of keys, or padding and causality as unmasked calls)."""

    def __init__(self, consumer, row_mask: RowMask | None):
        self.consumer, self.row_mask = consumer, row_mask
        self.mean_of: dict = {}   # V's mean over every key, once per call (eager masks' rows that see no key)

    def __call__(self, q, k, v, *, q_offset, causal, scale, mask=None, softcap=0.0, sinks=None):
        cap = {"softcap": softcap} if softcap else {}   # soft-capped scores (hand-written attention): said only then
        if sinks is not None:                            # attention sinks: likewise
            cap["sinks"] = sinks
        consumer, row_mask = self.consumer, self.row_mask
        if row_mask is None:   # a mask the block was given: its chunk rows (or whole, over the keys alone)
            return consumer.attend(q, k, v, q_offset=q_offset, causal=causal, mask=mask, scale=scale, **cap)
        a, b = q_offset, q_offset + q.shape[-2]
        if row_mask.flex is not None:   # a flex mask over the rows and the keys after them: the consumer cuts it
            return consumer.attend(q, k, v, q_offset=a, causal=False, mask=row_mask.flex, scale=scale, **cap)
        if row_mask.spans is not None:   # padding and causality: each batch element's keys without a mask
            return attend_spans(consumer, row_mask, q, k, v, a, scale, cap, self.mean_of)
        lo, hi = row_mask.span(a, b)
        part = row_mask.part(a, b, lo, hi)
        out = consumer.attend(q, k[..., lo:hi, :], v[..., lo:hi, :], q_offset=a - lo, causal=False, mask=part,
                              scale=scale, **cap)
        if row_mask.blind_rows_see_all:
            out = blind_rows_see_all(out, part, v, self.mean_of)
        return out


def attend_spans(consumer, row_mask: RowMask, q, k, v, a: int, scale, cap: dict, mean_of: dict):
    """Query rows [a, a + c) of a padded batch whose mask is padding and causality alone (``RowMask.spans``): for each
    batch element with keys [s, e) not padding, rows from s to e attend causally from key s, rows past e attend all of
    [s, e), each through the consumer's own unmasked calls; rows before s (no key to see) get the library's mask rows,
    as stock attends them."""
    b = a + q.shape[-2]
    out = q.new_empty(q.shape)
    for i, (s, e) in enumerate(row_mask.spans):
        qi, ki, vi = q[i:i + 1], k[i:i + 1], v[i:i + 1]
        blind = min(b, s) if e > s else b     # rows [a, blind) see no key
        if blind > a and row_mask.blind_rows_see_all:   # eager: every key of the call evenly
            out[i:i + 1, :, :blind - a] = mean_v(v, out, mean_of)[i:i + 1]
        elif blind > a:
            lo, hi = row_mask.span(a, blind)
            out[i:i + 1, :, :blind - a] = consumer.attend(
                qi[:, :, :blind - a], ki[:, :, lo:hi], vi[:, :, lo:hi], q_offset=0, causal=False,
                mask=row_mask.part(a, blind, lo, hi)[i:i + 1], scale=scale, **cap)
        r0, r1 = max(a, blind), min(b, e)
        if r1 > r0:
            out[i:i + 1, :, r0 - a:r1 - a] = consumer.attend(
                qi[:, :, r0 - a:r1 - a], ki[:, :, s:e], vi[:, :, s:e], q_offset=r0 - s, causal=True, mask=None,
                scale=scale, **cap)
        r0 = max(a, blind, r1)
        if b > r0:   # rows past the last key that is not padding: all of [s, e)
            out[i:i + 1, :, r0 - a:] = consumer.attend(
                qi[:, :, r0 - a:], ki[:, :, s:e], vi[:, :, s:e], q_offset=0, causal=False, mask=None, scale=scale,
                **cap)
    return out


def blind_rows_see_all(out: torch.Tensor, part: torch.Tensor, v: torch.Tensor, mean_of: dict) -> torch.Tensor:
    """Rows of ``part`` (the chunk's eager mask rows, [B, 1, c, keys]) that see no key: the mean of V over every key
    of the call, as eager attention gives them (the same minimum added to every score: an even softmax)."""
    seen = part if part.dtype == torch.bool else part > torch.finfo(part.dtype).min / 2
    blind = ~seen.any(-1, keepdim=True)                       # [B, 1, c, 1]
    return torch.where(blind, mean_v(v, out, mean_of), out, out=out)   # in place: no copy of the chunk's output


def mean_v(v: torch.Tensor, out: torch.Tensor, mean_of: dict) -> torch.Tensor:
    """V's mean over every key of the call, per query head ([B, H, 1, D]), once per V buffer (L3 attends a buffer
    per head group: held weakly, a later group's buffer is never taken for an earlier one's)."""
    held = mean_of.get("v")
    if held is None or held[0]() is not v:
        # summed in fp32 a chunk's rows of keys at a time: a whole fp32 copy of V is a transient no plan charges
        step, n = max(1, out.shape[-2]), v.shape[-2]
        total = sum(v[..., s:s + step, :].sum(-2, keepdim=True, dtype=torch.float32) for s in range(0, n, step))
        mean = total.div_(n).to(out.dtype).repeat_interleave(out.shape[1] // v.shape[1], 1)
        held = mean_of["v"] = (weakref.ref(v), mean)
    return held[1]
