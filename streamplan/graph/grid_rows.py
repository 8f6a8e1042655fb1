"""Rows laid out on a grid: a block that unflattens its rows to ``[lines, width]`` with both extents passed as ints
(an image plane's height and width) is captured with the row count ``width * lines``, ``lines`` symbolic and the
width static, so chunks of whole lines keep the reshape valid; and a convolution over that plane reads a reach of
whole lines around each of its own (its halo), read off its kernel size, padding and dilation.

The capture side (``grid_of_call``, ``grid_forward``) finds the int arguments and traces a forward that computes the
leading extent from the rows' size; the analysis side (``lines_unit``, ``plane_conv_halo``) is called by
``analyze`` for values whose rows dimension counts lines."""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import sympy
import torch
from torch import nn

from .op_names import NotRowLocal


@dataclass(frozen=True)
class Grid:
    """The call's rows as ``[lines, width]``: ``lines`` given as the int argument ``leading`` (traced as the rows'
    size divided by ``unit``), the static extents after it (``width``, or height and width) multiplied to ``unit``."""

    leading: str       # the forward's parameter holding the line count
    unit: int          # rows per line: the product of the static extents after it


def grid_of_call(arguments: dict[str, Any], rows: int) -> Grid | None:
    """The grid of a call whose int arguments, consecutive in the forward's order, multiply to the row count
    (``height, width``); the first is the line count. None where no such run exists, or where it is ambiguous."""
    names = list(arguments)
    found = []
    for i, name in enumerate(names):
        run, product = [], 1
        for other in names[i:]:
            v = arguments[other]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                break
            run.append(v)
            product *= v
            if product >= rows:
                break
        if len(run) >= 2 and product == rows and run[0] > 1 and math.prod(run[1:]) > 1:
            found.append(Grid(name, math.prod(run[1:])))
    return found[0] if len(found) == 1 else None


@contextmanager
def grid_forward(module: nn.Module, grid: Grid | None, row_arg: str, row_dim: int) -> Iterator[None]:
    """While traced: a forward that computes the line count from the rows' size (``row_arg``'s dimension
    ``row_dim`` divided by the unit) in place of the int argument, which export would bake in as a constant."""
    if grid is None:
        yield
        return
    cls_forward = type(module).forward
    sig = inspect.signature(cls_forward)

    def lines_forward(*args, **kwargs):
        bound = sig.bind(module, *args, **kwargs)
        bound.arguments[grid.leading] = bound.arguments[row_arg].shape[row_dim] // grid.unit
        return cls_forward(*bound.args, **bound.kwargs)

    lines_forward.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    installed = module.__dict__.get("forward")
    module.forward = lines_forward
    try:
        yield
    finally:
        if installed is not None:
            module.forward = installed
        else:
            del module.forward


def row_argument(arguments: dict[str, Any], rows: int) -> tuple[str, int] | None:
    """The first tensor argument with a dimension of ``rows``, and that dimension (the line count is read off it)."""
    for name, v in arguments.items():
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if s == rows:
                    return name, d
    return None


# -- analysis ---------------------------------------------------------------------------------------------------

def lines_unit(expr: sympy.Expr, symbol: sympy.Symbol, unit: int) -> int | None:
    """Rows per index of a dimension of size ``expr`` where the row count is ``unit * symbol``: ``k`` where the size
    is the row count over ``k`` (``k`` dividing the capture's unit, so whole lines of a chunk are whole ``k``s), else
    None."""
    ratio = sympy.simplify(unit * symbol / expr)
    if ratio.is_Integer and int(ratio) > 1 and unit % int(ratio) == 0:
        return int(ratio)
    return None


class PlaneConvRefused(Exception):
    """A convolution over the grid whose reach cannot be proved (the message says why)."""


def plane_conv_halo(args: dict, lines_dim: int, unit: int, ndim: int) -> tuple[int, int]:
    """Rows before and after its own that a 2-D convolution over ``[batch, channels, lines, width]`` reads, in
    whole lines: stride 1, output the size of its input (the width's padding is the convolution's own at every
    line, as stock pads it). Its reach in lines from the kernel's height, padding and dilation, never guessed."""
    if ndim != 4 or lines_dim != 2:
        raise PlaneConvRefused("a convolution over the rows' grid whose input is not [batch, channels, lines, width]")
    if args.get("transposed") or list(args.get("stride") or [1, 1]) not in ([1, 1], [1]):
        raise PlaneConvRefused("a convolution over the rows' grid with a stride or transposed")
    weight = args["weight"].meta["val"]
    kh, kw = int(weight.shape[-2]), int(weight.shape[-1])
    dil = list(args.get("dilation") or [1, 1])
    dh, dw = (int(dil[0]), int(dil[-1]))
    padding = args.get("padding", [0, 0])
    reach_h, reach_w = dh * (kh - 1), dw * (kw - 1)
    if padding == "same":
        ph, pw = reach_h // 2, reach_w // 2
        same = True
    elif isinstance(padding, (list, tuple)) and all(isinstance(p, int) for p in padding) and len(padding) in (1, 2):
        ph, pw = int(padding[0]), int(padding[-1])
        same = 2 * ph == reach_h and 2 * pw == reach_w
    else:
        raise PlaneConvRefused(f"a convolution over the rows' grid with padding {padding!r}")
    if not same:
        raise PlaneConvRefused(f"a convolution over the rows' grid whose output is not its input's size (kernel "
                               f"{kh}x{kw}, padding {padding!r}, dilation {dil!r})")
    width = unit
    return ph * width, (reach_h - ph) * width


def grid_cut(an: Any, name: str, args: dict, inputs: list) -> None:
    """A cut or join of a value laid out as the grid (``chunk`` of its channels for a gate): refused along its lines
    or its width (a chunk holds whole lines, never part of one), and any padding of it."""
    if name in ("pad", "constant_pad_nd"):
        raise NotRowLocal(f"{name} of a value laid out as the rows' grid")
    dim = args.get("dim", 0)
    for n, r in inputs:
        if r.unit == 1:
            continue
        d = an.norm_dim(dim, n.meta["val"].dim()) if isinstance(dim, int) else None
        if d is None or d in (r.dim, r.dim + 1):
            raise NotRowLocal(f"{name} along the lines or the width of the rows' grid")
