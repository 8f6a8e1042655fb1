"""The streamed model forwards' input projections (Wan's and HunyuanVideo's Conv3d patch embeddings, MiniMax-H3's video
and audio projections, Flux's and Chroma's ``img_in``): one loop for all of them (``project_into`` over ``grid_chunks``
or ``row_chunks``), so the row chunks and the writes into the hidden-state buffer are made one way, and each forward
runs it inside ``forward_loops.row_loop`` (the projection's weights cast once, not per chunk). ``grid_chunk_bounds`` is
the one place a patched latent grid is split into row chunks."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from ...execute.chunk_loop import chunk_bounds

Chunk = tuple[tuple[int, int], torch.Tensor]   # rows [a, b) of the output and what they are projected from


def grid_chunk_bounds(grid: tuple[int, int, int], chunk: int):
    """Row chunks of a patched (frames, height, width) grid whose rows run frame by frame, row by row: whole frames
    where a frame fits the chunk, else bands of whole grid rows of one frame. Yields ((t0, t1), (h0, h1), (a, b)):
    the grid's frame and height range and the rows [a, b) they are."""
    frames, height, width = grid
    per_frame = height * width
    if per_frame <= chunk:
        step = chunk // per_frame
        for t0 in range(0, frames, step):
            t1 = min(frames, t0 + step)
            yield (t0, t1), (0, height), (t0 * per_frame, t1 * per_frame)
        return
    band = max(1, chunk // width)
    for t in range(frames):
        for h0 in range(0, height, band):
            h1 = min(height, h0 + band)
            yield (t, t + 1), (h0, h1), (t * per_frame + h0 * width, t * per_frame + h1 * width)


def grid_chunks(x: torch.Tensor, patch: tuple[int, int, int], chunk: int) -> Iterator[Chunk]:
    """The latent ``x`` ``[batch, channels, frames, height, width]`` (padded to ``patch``) by ``grid_chunk_bounds``:
    each chunk's rows [a, b) and the latent region (whole patches) they are made from."""
    pt, ph, pw = patch
    grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
    for (t0, t1), (h0, h1), bounds in grid_chunk_bounds(grid, chunk):
        yield bounds, x[:, :, t0 * pt:t1 * pt, h0 * ph:h1 * ph]


def row_chunks(x: torch.Tensor, chunk: int, dim: int = 1) -> Iterator[Chunk]:
    """Rows already laid out along ``dim`` of ``x``, by ``chunk``: each chunk and its rows."""
    for a, b in chunk_bounds(x.shape[dim], chunk):
        yield (a, b), x.narrow(dim, a, b - a)


def project_into(out: torch.Tensor, chunks: Iterable[Chunk], project: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``out``'s rows (its second-to-last axis) [a, b) = ``project(source)`` for every chunk, cast to ``out``'s dtype
    on the copy, so no whole-sequence tensor of the projection's own dtype is made."""
    for (a, b), source in chunks:
        projected = project(source)
        out[..., a:b, :] = projected
        del projected
