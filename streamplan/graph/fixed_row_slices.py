"""Rows cut at a fixed count and joined back: ``x[:, :n]`` and ``x[:, n:]`` (or ``split_with_sizes`` / ``narrow``
at bounds that are constants or the row count plus a constant), each side run through its own row-local ops, then
``cat`` along the rows. A block that gives the first ``n`` rows their own modulation does this.

The bounds are read once, at analysis, in the coordinates of the whole call (static rows before included) and
evaluated at the call's row count. A chunk takes the part of each side that falls within its rows, re-based to the
chunk, and possibly empty: the ops on a side are row-local, so they run on zero rows as on any other count, and
the join of the chunk's parts is the chunk's rows in order. That is exact for every chunk without moving the chunk
boundaries (which the planner and the retry in halves place freely). What a side may do is kept to a list of ops
that never read its row count (a reshape that names it, a size read off it, an attention whose keys are its rows
are refused): the count a chunk holds of a side differs from the count the trace saw.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch
from torch import fx

from .analyze import IGNORED_OPS, NotRowLocal, Rows, bind
from .op_names import op_name, pointwise

CUTS = {"slice", "narrow", "split", "split_with_sizes", "tensor_split"}
_SAME = {"_to_copy", "to", "type_as", "clone", "contiguous", "detach", "alias", "lift_fresh_copy", "dropout"}
_NORMS = {"layer_norm", "rms_norm"}
_LAYOUT = {"unsqueeze", "squeeze", "permute", "transpose", "unflatten", "flatten"}
_REDUCE = {"mean", "sum", "amax", "amin"}


@dataclass(frozen=True)
class RowSpan(Rows):
    """A value holding rows [lo, hi) of the rows laid out as ``Rows(dim, pre, post)`` (whole-call coordinates, static
    rows before counted), ``lo`` and ``hi`` expressions of the row count: what a cut at a fixed count gives."""

    lo: Any = sympy.Integer(0)
    hi: Any = sympy.Integer(0)
    cut_side: ClassVar[bool] = True   # what ``row_pieces`` asks (without importing this module: no import cycle)

    def same_rows(self, other: Rows) -> bool:
        return isinstance(other, RowSpan) and (self.pre, self.post) == (other.pre, other.post) and \
            sympy.expand(self.lo - other.lo) == 0 and sympy.expand(self.hi - other.hi) == 0


@dataclass(frozen=True)
class FixedCut:
    """A cut along the rows at fixed bounds: ``spans`` (one per output; ``many`` for a split's list) in the
    coordinates of the input's rows ``Rows(dim, pre, post)``."""

    dim: int
    pre: int
    post: int
    spans: tuple[tuple[Any, Any], ...]
    many: bool

    def bounds_at(self, rows: int, symbol) -> list[tuple[int, int]]:
        """Each span's [lo, hi) at a call of ``rows`` rows, clamped as ``slice`` clamps (worked out once per call)."""
        return _bounds(self, rows, symbol)


@functools.lru_cache(maxsize=256)
def _bounds(c: FixedCut, rows: int, symbol) -> list[tuple[int, int]]:
    total = c.pre + rows + c.post
    out = []
    for lo, hi in c.spans:
        a = min(max(int(sympy.sympify(lo).subs(symbol, rows)), 0), total)
        b = min(max(int(sympy.sympify(hi).subs(symbol, rows)), a), total)
        out.append((a, b))
    return out


# -- analysis ---------------------------------------------------------------------------------------------------
def _affine(e, s) -> bool:
    """A bound that is a constant or the row count plus a constant (never a value read off the data)."""
    e = sympy.expand(e)
    if not e.free_symbols <= {s}:
        return False
    c = sympy.expand(e - s) if s in e.free_symbols else e
    return c.is_Integer


def cut(an, node: fx.Node, x: Rows, bounds: list[tuple[Any, Any]], many: bool, why: str):
    """A cut of ``x``'s rows at ``bounds`` (expressions of the row count in ``x``'s coordinates), recorded for the
    executor (``an.fixed_cuts``); its output's rows, or a list of them for a split. ``why`` the reason the plain rules
    refused it, kept where this one refuses too."""
    s = an.s
    if isinstance(x, RowSpan):
        raise NotRowLocal(f"{why}; a cut of rows already cut at a fixed count")
    if getattr(an, "unit", 1) != 1 or getattr(x, "unit", 1) != 1:
        raise NotRowLocal(f"{why}; a cut at a fixed count of rows laid out as a grid")
    for lo, hi in bounds:
        if not (_affine(lo, s) and _affine(hi, s)):
            raise NotRowLocal(f"{why}; its bounds ({lo}, {hi}) are not fixed counts (read off the data?)")
    an.fixed_cuts[node] = FixedCut(x.dim, x.pre, x.post, tuple((sympy.expand(lo), sympy.expand(hi))
                                                                for lo, hi in bounds), many)
    spans = [RowSpan(x.dim, x.pre, x.post, lo=sympy.expand(lo), hi=sympy.expand(hi)) for lo, hi in bounds]
    return spans if many else spans[0]


def fixed_cut(an, node: fx.Node, name: str, args: dict, x: Rows, x_val, val, refused: NotRowLocal):
    """A cut along the rows the plain rules refused (``refused``): taken as a cut at a fixed count where it is one,
    else ``refused`` raised again."""
    if name not in CUTS or (name == "slice" and (args.get("step") or 1) != 1):
        raise refused
    return cut(an, node, x, slice_bounds(an, name, args, x, x_val, val), isinstance(val, (list, tuple)),
               str(refused))


def touches_spans(an, nodes) -> bool:
    """Whether any of ``nodes`` holds rows cut at a fixed count (a rewrite that cuts a chunk's rows into pieces or
    reads their count leaves them alone)."""
    return any(isinstance(r, RowSpan) or (isinstance(r, list) and any(isinstance(p, RowSpan) for p in r))
               for r in (an.rows.get(n) for n in nodes))


def slice_bounds(an, name: str, args: dict, x: Rows, x_val, val) -> list[tuple[Any, Any]]:
    """[lo, hi) of each output of a cut along the rows, from its start and its outputs' sizes as traced."""
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    if name == "slice":
        start = an.expr(args.get("start") or 0)
        if (start.is_Integer and int(start) < 0) or (not start.is_Integer and bool(start.subs(an.s, 10 ** 9) < 0)):
            start = sympy.expand(an.expr(x_val.shape[x.dim]) + start)
    elif name == "narrow":
        start = an.expr(args["start"])
    else:
        start = sympy.Integer(0)
    out = []
    for v in vals:
        length = an.expr(v.shape[x.dim])
        out.append((start, sympy.expand(start + length)))
        start = sympy.expand(start + length)
    return out


def reads_span(an, node: fx.Node) -> bool:
    """Whether ``node`` reads a value holding rows cut at a fixed count (``through`` then says what it gives)."""
    return node.target is not operator.getitem and node.target not in IGNORED_OPS and any(
        isinstance(an.rows.get(m), RowSpan) for m in node.all_input_nodes)


def through(an, node: fx.Node):
    """The rows of an op reading rows cut at a fixed count: the same span where the op is row-local and never reads
    the span's row count; the rows joined back where it is a ``cat`` of spans that tile; else refused, named."""
    name = op_name(node.target)
    val = node.meta.get("val")
    spans = [(m, an.rows[m]) for m in node.all_input_nodes if isinstance(an.rows.get(m), RowSpan)]
    m0, r0 = spans[0]
    if not isinstance(node.target, torch._ops.OpOverload) or an.random(node):
        raise NotRowLocal(f"{name} of rows cut at a fixed count")
    others = [m for m in node.all_input_nodes if isinstance(an.rows.get(m), Rows) and m not in dict(spans)]
    if others and name not in ("cat", "concat"):
        raise NotRowLocal(f"{name} joins rows cut at a fixed count with other rows")
    if any(not r.same_rows(r0) for _, r in spans) and name not in ("cat", "concat"):
        raise NotRowLocal(f"{name} joins rows cut at different fixed counts")
    if any(isinstance(m.meta.get("val"), torch.SymInt) for m in node.all_input_nodes):
        raise NotRowLocal(f"{name} of rows cut at a fixed count reads a size counted in rows")
    if not isinstance(val, torch.Tensor):
        raise NotRowLocal(f"{name} of rows cut at a fixed count gives no tensor (reads their count?)")
    args = bind(node)
    if name in ("cat", "concat"):
        return _join(an, node, args, val)
    if name in CUTS:
        raise NotRowLocal(f"{name} of rows already cut at a fixed count")
    dim = _out_dim(an, node, name, args, m0, r0, val)
    if pointwise(node.target) and any(m.meta["val"].dim() - r.dim != val.dim() - dim for m, r in spans):
        raise NotRowLocal(f"{name} broadcasts rows cut at a fixed count against another dimension")
    for m in node.all_input_nodes:   # a value without rows must broadcast over the span's rows, not meet them
        v = m.meta.get("val")
        if isinstance(v, torch.Tensor) and not isinstance(an.rows.get(m), Rows):
            i = dim - (val.dim() - v.dim())
            if 0 <= i < v.dim() and not (isinstance(v.shape[i], int) and v.shape[i] == 1) and \
                    name not in ("linear", "matmul", "scaled_dot_product_attention") and not _norm_weight(node, m):
                raise NotRowLocal(f"{name} meets rows cut at a fixed count with a value of their traced count")
    return RowSpan(dim, r0.pre, r0.post, lo=r0.lo, hi=r0.hi)


def _norm_weight(node: fx.Node, m: fx.Node) -> bool:
    return op_name(node.target) in _NORMS and m is not node.args[0]


def _out_dim(an, node: fx.Node, name: str, args: dict, m0: fx.Node, r0: RowSpan, val) -> int:
    """Where the span's rows are in the op's output, for the ops a side may run; anything else is refused."""
    xv = m0.meta["val"]
    aligned = r0.dim + val.dim() - xv.dim()   # counted from the right, as broadcasting aligns
    if pointwise(node.target) or name in _SAME:
        return aligned
    if name == "linear" or name == "matmul":
        if m0 is not node.args[0] or r0.dim >= xv.dim() - 1:
            raise NotRowLocal(f"{name} contracts over rows cut at a fixed count")
        return aligned
    if name in _NORMS:
        if m0 is not node.args[0] or r0.dim >= xv.dim() - len(args.get("normalized_shape") or []):
            raise NotRowLocal(f"{name} normalises over rows cut at a fixed count")
        return aligned
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        if an.norm_dim(args["dim"], xv.dim()) == r0.dim:
            raise NotRowLocal(f"{name} along rows cut at a fixed count")
        return aligned
    if name in _REDUCE:
        dims = args.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        dims = {an.norm_dim(d, xv.dim()) for d in dims}
        if not dims or r0.dim in dims:
            raise NotRowLocal(f"{name} over rows cut at a fixed count")
        return r0.dim if args.get("keepdim") else r0.dim - sum(1 for d in dims if d < r0.dim)
    if name in _LAYOUT:
        return _layout_dim(an, name, args, r0.dim, xv.dim())
    if name == "scaled_dot_product_attention":
        if m0 is not args["query"] or any(isinstance(an.rows.get(args[k]), Rows) for k in ("key", "value")) or \
                args.get("attn_mask") is not None or args.get("is_causal") or float(args.get("dropout_p") or 0):
            raise NotRowLocal("an attention over rows cut at a fixed count (its keys, a mask or causal)")
        return r0.dim
    raise NotRowLocal(f"op {name} on rows cut at a fixed count")


def _layout_dim(an, name: str, args: dict, d: int, ndim: int) -> int:
    """The rows' dimension after a layout change that keeps them whole."""
    if name == "unsqueeze":
        at = an.norm_dim(args["dim"], ndim + 1)
        return d + 1 if at <= d else d
    if name == "squeeze":
        dims = args.get("dim")
        if dims is None:
            raise NotRowLocal("squeeze of rows cut at a fixed count (a chunk's side may hold one row)")
        dims = {an.norm_dim(x, ndim) for x in ([dims] if isinstance(dims, int) else dims)}
        if d in dims:
            raise NotRowLocal("squeeze of rows cut at a fixed count (a chunk's side may hold one row)")
        return d - sum(1 for x in dims if x < d)
    if name == "permute":
        return [an.norm_dim(x, ndim) for x in args["dims"]].index(d)
    if name == "transpose":
        a, b = an.norm_dim(args["dim0"], ndim), an.norm_dim(args["dim1"], ndim)
        return b if d == a else a if d == b else d
    if name == "unflatten":
        at = an.norm_dim(args["dim"], ndim)
        if at == d:
            raise NotRowLocal("unflatten of rows cut at a fixed count")
        return d + len(args["sizes"]) - 1 if at < d else d
    start, end = an.norm_dim(args.get("start_dim", 0), ndim), an.norm_dim(args.get("end_dim", -1), ndim)
    if start <= d <= end and start != end:
        raise NotRowLocal("flatten of rows cut at a fixed count")
    return d - (end - start) if d > end else d


def _join(an, node: fx.Node, args: dict, val) -> Rows:
    """A ``cat`` of spans: along the rows, spans that tile give the rows back (or a wider span); along another
    dimension, the same span."""
    tensors = list(args["tensors"])
    rows = [an.rows.get(t) if isinstance(t, fx.Node) else None for t in tensors]
    if not all(isinstance(r, RowSpan) for r in rows):
        raise NotRowLocal("cat joins rows cut at a fixed count with values that are not")
    d = an.norm_dim(args.get("dim", 0), val.dim())
    first = rows[0]
    if any(r.dim != first.dim or (r.pre, r.post) != (first.pre, first.post) for r in rows):
        raise NotRowLocal("cat joins rows cut at a fixed count laid out otherwise")
    if d != first.dim:
        if any(not r.same_rows(first) for r in rows):
            raise NotRowLocal("cat joins rows cut at different fixed counts along another dimension")
        return RowSpan(first.dim, first.pre, first.post, lo=first.lo, hi=first.hi)
    for r, nxt in zip(rows, rows[1:]):
        if sympy.expand(r.hi - nxt.lo) != 0:
            raise NotRowLocal("cat joins rows cut at a fixed count that do not follow one another")
    lo, hi = rows[0].lo, rows[-1].hi
    an.fixed_joins.add(node)
    if sympy.expand(lo) == 0 and sympy.expand(hi - (first.pre + an.s + first.post)) == 0:
        return Rows(first.dim, first.pre, first.post)
    return RowSpan(first.dim, first.pre, first.post, lo=lo, hi=hi)


def problem(an, outputs: list) -> str | None:
    """Why cuts at a fixed count cannot run in this graph: an output holding a side alone, or a halo (a chunk widened
    by it would need its cuts re-based past its own rows)."""
    if not an.fixed_cuts:
        return None
    if any(isinstance(an.rows.get(o), RowSpan) for o in outputs if isinstance(o, fx.Node)):
        return "an output holds rows cut at a fixed count without the rest"
    if an.halo != (0, 0):
        return "rows cut at a fixed count in a block with a convolution along the rows"
    return None


# -- execution ----------------------------------------------------------------------------------------------------
def run_cut(c: FixedCut, x: torch.Tensor, rows: int, a: int, dynamic_only: bool, symbol) -> Any:
    """The cut on one chunk: ``x`` holds the chunk's dynamic rows from ``a`` on (with the static rows around them
    unless ``dynamic_only``); each span's part within them, re-based to the chunk (a view, possibly empty)."""
    held = x.shape[c.dim]
    count = held if dynamic_only else held - c.pre - c.post

    def local(i: int) -> int:   # how many of the rows the chunk holds come before row ``i`` of the call
        n = min(max(i - c.pre - a, 0), count)
        if not dynamic_only:
            n += min(max(i, 0), c.pre) + min(max(i - c.pre - rows, 0), c.post)
        return n

    parts = [x.narrow(c.dim, local(lo), local(hi) - local(lo)) for lo, hi in c.bounds_at(rows, symbol)]
    return parts if c.many else parts[0]
