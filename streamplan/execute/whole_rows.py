"""Whole-rows buffers a phase fills chunk by chunk (an attention's K and V, a contraction's inputs, the block's
outputs): laid out as a chunk is, each chunk's rows written in (with the static rows around them on the first)."""
from __future__ import annotations

import torch

from ..graph.analyze import Rows
from ..specs import address, storage_address


def write_chunk_rows(dst: torch.Tensor, src: torch.Tensor, r: Rows, total: int, a: int, b: int, first: bool) -> None:
    """Chunk rows [a:b) into a whole buffer of ``total`` dynamic rows: with its static rows around them on the first
    chunk, the dynamic rows alone after it."""
    d = r.dim
    to, rows = dst.narrow(d, r.pre + a, b - a), src.narrow(d, r.pre if first else 0, b - a)
    if not same_elements(to, rows):   # a donated input the block updated in place is its own output already
        if storage_address(rows) == storage_address(to):
            rows = rows.clone()   # in the buffer, laid out otherwise: a copy would read what it has overwritten
        to.copy_(rows, non_blocking=True)   # into host rows (L6): in the compute stream's order
    if first and r.pre:
        dst.narrow(d, 0, r.pre).copy_(src.narrow(d, 0, r.pre))
    if first and r.post:
        dst.narrow(d, r.pre + total, r.post).copy_(src.narrow(d, r.pre + (b - a), r.post))


def same_elements(x: torch.Tensor, y: torch.Tensor) -> bool:
    return address(x) == address(y) and x.shape == y.shape and all(
        n == 1 or a == b for n, a, b in zip(x.shape, x.stride(), y.stride()))


def whole_buffer(like: torch.Tensor, r: Rows, total: int) -> torch.Tensor:
    """A whole-rows buffer laid out as the chunk is (K as a permuted [B, N, H, D] stays so): the attention kernel
    reads the layout stock would give it, and each chunk's write is a straight copy, not a transpose."""
    shape = list(like.shape)
    shape[r.dim] = r.pre + total + r.post
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))   # outermost dimension first
    buf = like.new_empty([shape[d] for d in order])
    return buf.permute([order.index(d) for d in range(like.dim())])
