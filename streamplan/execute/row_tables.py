"""Per-row tables a model forward builds for every row in stock, described instead (``specs.RowsFrom``). From a
per-row timestep: a model that hands every row its own timestep (image-to-video's clean conditioning frames, a
timestep per token) builds its modulation for every row, a table as wide as several residuals; a video has a few
distinct timesteps, so the table is computed once per distinct value and each chunk of rows picks its own. From
positions: rotary tables, a chunk's rows built from its rows' positions (``described_together``)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .call_state import rehearsing
from ..specs import RowsFrom


class DistinctRows:
    """A per-row timestep ``[B, N]`` as its distinct values and each row's index among them."""

    def __init__(self, timestep: torch.Tensor):
        self.batch, self.rows = timestep.shape
        if rehearsing() or timestep.device.type == "meta":   # no values (a rehearsal's fakes, a plan on shapes):
            #                                                     one distinct value stands in (the tables are small)
            self.values = timestep.flatten()[:1]
            self.index = torch.zeros_like(timestep, dtype=torch.long)
        else:
            self.values, inverse = torch.unique(timestep.flatten(), return_inverse=True)
            self.index = inverse.view(self.batch, self.rows)

    def pick(self, table: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of the per-row tensor ``table`` (one row per distinct value) stands for: ``[B, b - a, ...]``."""
        return table[self.index[:, a:b]]

    def rows_of(self, table: torch.Tensor) -> RowsFrom:
        """``table`` (``[U, ...]``, one row per distinct value) as the per-row ``[B, N, ...]`` tensor stock builds."""
        return RowsFrom(lambda a, b: self.pick(table, a, b),
                        torch.Size((self.batch, self.rows, *table.shape[1:])), table.dtype, table.device)


def described_together(make: Callable[[int, int], Sequence[torch.Tensor]], rows: int,
                       dims: Sequence[int]) -> tuple[RowsFrom, ...]:
    """The tensors ``make(a, b)`` returns together (a rotary (cos, sin) pair from rows [a, b)'s positions), each
    described over ``rows`` along its own dim in ``dims``. One call builds a chunk's rows of all of them, held until
    each has been read once (in any order), then let go before another chunk's are built."""
    held: dict = {}

    def part(i: int) -> Callable[[int, int], torch.Tensor]:
        def one(a: int, b: int) -> torch.Tensor:
            if held.get("rows") != (a, b):
                held.clear()
                held.update(rows=(a, b), parts=tuple(make(a, b)), left=set(range(len(dims))))
            t = held["parts"][i]
            held["left"].discard(i)
            if not held["left"]:
                held.clear()
            return t
        return one

    probe = tuple(make(0, 1))
    shapes = []
    for t, dim in zip(probe, dims):
        shape = list(t.shape)
        shape[dim] = rows
        shapes.append(torch.Size(shape))
    return tuple(RowsFrom(part(i), shapes[i], t.dtype, t.device, dims[i]) for i, t in enumerate(probe))
