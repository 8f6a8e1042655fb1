"""Streamed blocks: phase KV over prefixed rows, then per chunk: Q, attention, and the rest of the block."""
from __future__ import annotations

import contextlib
import threading

import torch

from ..ir import BlockCall
from .attention import attend_rows, global_kv, head_grouped_outputs
from .chunks import for_chunks


class _Donated(threading.local):
    tensors: tuple = ()


_DONATED = _Donated()


@contextlib.contextmanager
def donate(*tensors: torch.Tensor):
    """Within this context a streamed block may update these inputs in place (a model forward that rebinds its
    hidden states to each block's output, and keeps no other reference, says so)."""
    previous, _DONATED.tensors = _DONATED.tensors, tensors
    try:
        yield
    finally:
        _DONATED.tensors = previous


def donated(x: torch.Tensor) -> bool:
    return any(x is t for t in _DONATED.tensors)


def run_block(call: BlockCall, consumer, chunk: int, head_groups: int = 1):
    """Peak: residual + global K/V + one chunk's transients (L1/L2), or residual + the attention output + one
    head group's K/V (L3, ``head_groups`` > 1).

    The residual is updated in place when its tensor was donated, else in a copy made once (the caller may still
    hold its input); either way it becomes the output, so no other whole-sequence tensor exists.
    """
    att = call.attention
    xs = [s.x if donated(s.x) else s.x.clone() for s in call.streams]
    prefix_rows = lambda i, seg, a, b: call.streams[i].prefix(xs[i][:, a:b], a, b)  # noqa: E731
    if head_groups > 1:
        grouped = head_grouped_outputs(att, consumer, chunk, head_groups, prefix_rows)
    else:
        k, v = global_kv(att, chunk, prefix_rows)
    start = 0
    for i, (stream, seg) in enumerate(zip(call.streams, att.segments)):
        x = xs[i]

        def work(a: int, b: int, i=i, x=x, stream=stream, seg=seg, start=start) -> None:
            rows = x[:, a:b]
            h = stream.prefix(rows, a, b)
            if head_groups > 1:
                y = seg.out(grouped[i][:, a:b], a, b)
            else:
                y = attend_rows(att, consumer, k, v, seg, h, start, a, b)
            rows.copy_(stream.suffix(rows, h, y, a, b))   # the only write: a failed chunk leaves rows as they were

        for_chunks(x.shape[1], chunk, work)
        start += x.shape[1]
    return call.finish(xs)
