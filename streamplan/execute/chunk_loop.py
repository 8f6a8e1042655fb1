"""The chunk loop every executor uses: bounded retry in halves when a chunk runs out of memory.

Each chunk's work writes its results only at its end, so a chunk that fails part-way leaves nothing behind and is
simply run again in two halves (at most ``MAX_SPLITS`` times deep); nothing is lost or applied twice.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator

import torch

from .call_state import rehearsed

MAX_SPLITS = 4


class _Events(threading.local):
    def __init__(self):
        self.retries: list[tuple[int, int]] = []


EVENTS = _Events()


def chunk_bounds(rows: int, chunk: int, least: int = 1) -> Iterator[tuple[int, int]]:
    """Row chunks of ``chunk`` rows, never a last one under ``least`` rows (joined to the one before): a captured
    graph holds from two rows, or from as many as its trace assumed. In a rehearsal (fake tensors) only the first
    two chunks and the last: the ones between repeat the second's shapes."""
    chunk = max(chunk, least)
    bounds = []
    a = 0
    while a < rows:
        b = min(a + chunk, rows)
        if 0 < rows - b < least:
            b = rows
        bounds.append((a, b))
        a = b
    return iter(rehearsed(bounds))


def for_chunks(rows: int, chunk: int, work: Callable[[int, int], None]) -> None:
    for a, b in chunk_bounds(rows, chunk):
        attempt(work, a, b, MAX_SPLITS)


def attempt(work: Callable[[int, int], None], a: int, b: int, depth: int) -> None:
    try:
        work(a, b)
        return
    except torch.OutOfMemoryError:
        if depth == 0 or b - a < 2:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    EVENTS.retries.append((a, b))
    mid = a + (b - a) // 2
    attempt(work, a, mid, depth - 1)
    attempt(work, mid, b, depth - 1)


def drain_retries() -> list[tuple[int, int]]:
    events, EVENTS.retries = EVENTS.retries, []
    return events
