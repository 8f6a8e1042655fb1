"""What a linear layer's weight format allows the executors to do with it."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LinearCaps:
    out_slice: bool   # rows of the weight (output features) can be used alone
    in_slice: bool    # columns of the weight (input features) can be used alone
    align: int = 1    # slices must start and end on multiples of this


ROWS_ONLY = LinearCaps(out_slice=False, in_slice=False)
_DENSE = LinearCaps(out_slice=True, in_slice=True, align=1)


def linear_caps(module: nn.Module) -> LinearCaps:
    """Plain ``nn.Linear`` allows slicing; an unknown layer (quantised, LoRA-wrapped, ...) is applied whole."""
    if type(module) is nn.Linear and "forward" not in module.__dict__:
        return _DENSE
    return ROWS_ONLY


def can_slice_out(*modules: nn.Module) -> bool:
    return all(linear_caps(m).out_slice for m in modules)


def can_slice_in(*modules: nn.Module) -> bool:
    return all(linear_caps(m).in_slice for m in modules)


def slice_align(*modules: nn.Module) -> int:
    align = 1
    for m in modules:
        a = linear_caps(m).align
        align = align * a // _gcd(align, a)
    return align


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
