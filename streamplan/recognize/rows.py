"""Rows of per-token tensors, for the model forwards' own row loops."""
from __future__ import annotations

import torch



def rows_of(t: torch.Tensor | None, a: int, b: int, dim: int) -> torch.Tensor | None:
    """Rows [a:b) of a per-token tensor along ``dim``; broadcast (size 1) dims pass through."""
    if t is None or t.shape[dim] == 1:
        return t
    return t.narrow(dim, a, b - a)
