"""Rows laid out on a grid: a block that unflattens its rows to ``[lines, width]`` (or ``[frames, height, width]``)
with every extent passed as an int (or all of them as one tuple of ints) is captured with the row count
``unit * lines``, the leading extent symbolic and the others static (their product the unit: a line's width, or a
frame's height x width), so chunks of whole lines
(whole frames) keep the reshape valid. A value's rows dimension then counts lines; the rest of a line may lie in any
other dimensions (``[frames, channels, height, width]`` for a convolution over each frame), since every op but those
along the lines dimension works on each line alone, and slicing the lines commutes with it. A convolution whose
spatial axis is the lines reads a reach of whole lines around each of its own (its halo: whole frames for a temporal
convolution), read off its kernel size, padding, dilation and stride; one whose batch is the lines reads none.

The capture side (``grid_of_call``, ``grid_forward``) finds the int arguments and traces a forward that computes the
leading extent from the rows' size; the analysis side (``lines_unit``, ``grid_conv_halo``, ``whole_slice``,
``grid_cut``) is called by ``analyze`` for values whose rows dimension counts lines."""
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
    index: int | None = None   # the line count's place where the extents come as one tuple (``(frames, h, w)``)

    def with_lines(self, arguments: dict[str, Any], lines: Any) -> Any:
        """The value of ``leading`` with the line count replaced by ``lines``."""
        if self.index is None:
            return lines
        extents = list(arguments[self.leading])
        extents[self.index] = lines
        return tuple(extents)


def grid_of_call(arguments: dict[str, Any], rows: int) -> Grid | None:
    """The grid of a call whose int arguments, consecutive in the forward's order, multiply to the row count
    (``height, width``), or one tuple argument of ints that does (``(frames, height, width)``); the first is the line
    count. None where no such run exists, or where it is ambiguous."""
    names = list(arguments)
    found = [Grid(name, math.prod(v[1:]), 0) for name, v in arguments.items() if _extents(v, rows)]
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


def _extents(v: Any, rows: int) -> bool:
    """Whether ``v`` is a tuple of ints, two or more, that multiply to the row count, the first and the rest's
    product over one."""
    return isinstance(v, tuple) and len(v) >= 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                        for x in v) \
        and math.prod(v) == rows and v[0] > 1 and math.prod(v[1:]) > 1


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
        lines = bound.arguments[row_arg].shape[row_dim] // grid.unit
        bound.arguments[grid.leading] = grid.with_lines(bound.arguments, lines)
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

def lines_unit(expr: sympy.Expr, symbol: sympy.Symbol, unit: int, outer: int = 1) -> int | None:
    """Rows per index of a dimension of size ``expr`` where the row count is ``unit * symbol``: ``k`` where the size
    is the row count over ``k`` (``k`` dividing the capture's unit, so whole lines of a chunk are whole ``k``s), else
    None. ``outer``: a static extent merged in front of the lines (``view(batch * frames, ...)``), the dimension
    holding that many runs of lines one after another, so its size is ``outer`` times theirs."""
    ratio = sympy.simplify(outer * unit * symbol / expr)
    if ratio.is_Integer and int(ratio) > 1 and unit % int(ratio) == 0:
        return int(ratio)
    return None


class GridConvRefused(Exception):
    """A convolution over the grid whose reach cannot be proved (the message says why)."""


CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution"}


def _per_axis(args: dict, name: str, axis: int, spatial: int, default: int) -> int:
    """A convolution's ``stride``, ``padding`` or ``dilation`` along spatial ``axis``: one value given for every
    axis, or one per axis."""
    v = args.get(name)
    v = [default] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]
    if len(v) not in (1, spatial) or not all(isinstance(x, int) for x in v):
        raise GridConvRefused(f"a convolution over the rows' grid with {name} {v!r}")
    return int(v[axis] if len(v) == spatial else v[0])


def grid_conv_halo(args: dict, rows_dim: int, unit: int, ndim: int, outer: int = 1) -> tuple[int, int]:
    """Rows before and after its own that a convolution reads where its input's dimension ``rows_dim`` counts rows
    in steps of ``unit`` (whole lines, or whole frames, of the grid; 1 for plain rows): none where that dimension is
    the batch (each line or frame convolved alone: a 3x3 convolution over each frame of a video); where it is a
    spatial axis, the reach along that axis alone, read off its kernel size, padding and dilation (stride 1, output
    the size of its input, zero padding as the op pads), times ``unit``. The other axes lie within a line, so their
    padding is the convolution's own at every line, as stock pads it. Lines merged with a static extent (``outer``)
    are convolved alone only as a batch: along an axis, a chunk's runs would meet where the whole's do not."""
    weight = args["weight"].meta["val"]
    if ndim != weight.dim():
        raise GridConvRefused("a convolution over the rows' grid of an unbatched input")
    if rows_dim == 0:
        return 0, 0
    if rows_dim == 1:
        raise GridConvRefused("a convolution over the rows' grid whose channels are the rows")
    if outer > 1:
        raise GridConvRefused("a convolution along the rows' grid whose lines are merged with a static dimension")
    spatial, axis = ndim - 2, rows_dim - 2
    if args.get("transposed"):
        raise GridConvRefused("a convolution over the rows' grid transposed")
    stride = _per_axis(args, "stride", axis, spatial, 1)
    if stride != 1:
        raise GridConvRefused(f"a convolution over the rows' grid with a stride of {stride} along its lines")
    kernel = int(weight.shape[2 + axis])
    dilation = _per_axis(args, "dilation", axis, spatial, 1)
    reach = dilation * (kernel - 1)
    padding = args.get("padding", [0])
    if padding == "same":
        left = reach // 2
    elif padding == "valid" and reach:
        raise GridConvRefused("a convolution over the rows' grid whose output is not its input's size (padding "
                               "'valid')")
    else:
        left = 0 if padding == "valid" else _per_axis(args, "padding", axis, spatial, 0)
        if 2 * left != reach:
            raise GridConvRefused(f"a convolution over the rows' grid whose output is not its input's size along "
                                   f"its lines (kernel {kernel}, padding {left}, dilation {dilation})")
    return left * unit, (reach - left) * unit


def whole_slice(an: Any, name: str, args: dict, inputs: list, val: Any) -> Any:
    """The input's rows where ``name`` is a slice of a value laid out as the grid that keeps every line (from the
    first, step 1, its size along the lines its input's: ``x[start:start + per_call]`` in a loop the trace ran once),
    so the value itself; else None."""
    if name != "slice" or len(inputs) != 1 or not isinstance(val, torch.Tensor) or (args.get("step") or 1) != 1:
        return None
    node, r = inputs[0]
    if r.unit == 1 or node is not args.get("self") or an.norm_dim(args.get("dim", 0), val.dim()) != r.dim:
        return None
    start = an.expr(args.get("start") or 0)
    whole = sympy.expand(an.expr(val.shape[r.dim]) - an.expr(node.meta["val"].shape[r.dim])) == 0
    return r if start == 0 and whole else None


def grid_cut(an: Any, name: str, args: dict, inputs: list) -> None:
    """A cut or join of a value laid out as the grid: refused along its lines (a chunk holds whole lines, never part
    of one), and any padding of it. Along any other dimension (``chunk`` of its channels for a gate, a cut within a
    line) each line's values come from that line alone, so slicing the lines commutes with it."""
    if name in ("pad", "constant_pad_nd"):
        raise NotRowLocal(f"{name} of a value laid out as the rows' grid")
    dim = args.get("dim", 0)
    for n, r in inputs:
        if r.unit == 1:
            continue
        d = an.norm_dim(dim, n.meta["val"].dim()) if isinstance(dim, int) else None
        if d is None or d == r.dim:
            raise NotRowLocal(f"{name} along the lines of the rows' grid")
