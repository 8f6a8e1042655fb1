"""Per-row tables from a per-row timestep: a model that hands every row its own timestep (image-to-video's clean
conditioning frames, a timestep per token) builds its modulation for every row in stock, a table as wide as
several residuals. A video has a few distinct timesteps, so the table is computed once per distinct value and each
chunk of rows picks its own (``specs.RowsFrom``)."""
from __future__ import annotations

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
