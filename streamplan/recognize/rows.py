"""Row-local building blocks shared by attention recognizers: projection slices and per-row rotary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..weights import can_slice_out


def linear_rows(linear: nn.Module, a: int, b: int):
    """A callable applying output features [a:b) of ``linear`` (a plain Linear's weight rows)."""
    w = linear.weight[a:b]
    bias = None if linear.bias is None else linear.bias[a:b]
    return lambda x: F.linear(x, w, bias)


def fused_parts(linear: nn.Module, parts: int) -> list | None:
    """Callables for each equal output part of a fused projection (q|k|v), or None when it cannot be sliced."""
    if not can_slice_out(linear) or linear.out_features % parts:
        return None
    width = linear.out_features // parts
    return [linear_rows(linear, i * width, (i + 1) * width) for i in range(parts)]


def rows_of(t: torch.Tensor | None, a: int, b: int, dim: int) -> torch.Tensor | None:
    """Rows [a:b) of a per-token tensor along ``dim``; broadcast (size 1) dims pass through."""
    if t is None or t.shape[dim] == 1:
        return t
    return t.narrow(dim, a, b - a)
