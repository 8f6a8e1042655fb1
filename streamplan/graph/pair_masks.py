"""Masks over rows x rows built inside a block, each Q chunk's rows built alone.

A block may build its attention mask over rows x rows from values over the rows: a key mask repeated over the query
rows and ANDed with its transpose, a [B, N] key mask expanded to [B, H, N, N], a given [B, 1, N, N] mask repeated
over the heads. Built whole such a mask is quadratic in the rows.
Every op between the values over the rows and the attention is element-wise or a change of layout, so a Q chunk's
rows of the mask come from slices of those values alone: the ops are run again on the slices, and the chunk gets
[.., chunk, keys]. Anything else on the way (a reduction, a matmul, a gather) keeps the block stock, named.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch import fx

from .op_names import op_name, pointwise

# ops run again on slices: the element-wise ones (besides those torch tags pointwise), layouts, broadcasts
_ELEMENTWISE = {"_to_copy", "to", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "type_as", "where",
                "masked_fill", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
                "logical_not", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge", "mul", "add", "sub", "neg",
                "__and__", "__or__", "__xor__", "__invert__"}
_SWAPS = {"transpose", "t", "permute"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}
_BROADCASTS = {"expand", "broadcast_to", "repeat"}
PAIR_OPS = _ELEMENTWISE | _SWAPS | _RESHAPES | _BROADCASTS | {"repeat_interleave"}


class NotSliceable(Exception):
    """An op on the way to a mask over rows x rows that streamplan cannot run on a chunk's slice (the message says
    which)."""


def is_pair_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and (
        op_name(node.target) in PAIR_OPS or pointwise(node.target))


def _size(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _one(size) -> bool:
    e = _size(size)
    return e.is_Integer and int(e) == 1


def _prefix(shape, dim: int) -> sympy.Expr:
    p = sympy.Integer(1)
    for size in shape[:dim]:
        p = p * _size(size)
    return sympy.expand(p)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def input_dims(node: fx.Node, dims: frozenset[int]) -> list[tuple[fx.Node, dict[int, int]]]:
    """For each tensor input of ``node``, which of its dimensions each sliced output dimension (``dims``) comes from
    (an output dimension broadcast from size 1 comes from none): the rule that slicing commutes with the op."""
    name, out = op_name(node.target), node.meta["val"]
    nd = out.dim()
    if name in _SWAPS:
        x = node.args[0]
        if name == "permute":
            perm = [p % nd for p in node.args[1]]
        else:
            d0, d1 = (node.args[1] % nd, node.args[2] % nd) if name == "transpose" else (0, 1)
            perm = list(range(nd))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        return [(x, {d: perm[d] for d in dims})]
    if name in _RESHAPES:
        x = node.args[0]
        shape = x.meta["val"].shape
        found = {}
        for d in dims:
            match = [i for i, s in enumerate(shape) if sympy.expand(_size(s) - _size(out.shape[d])) == 0
                     and sympy.expand(_prefix(shape, i) - _prefix(out.shape, d)) == 0]
            if not match:
                raise NotSliceable(f"{name} mixes the rows of a mask over rows x rows with other dimensions")
            found[d] = match[0]
        return [(x, found)]
    if name == "repeat_interleave":
        x, rdim = node.args[0], node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if not isinstance(node.args[1], int) or rdim is None or rdim % nd in dims:
            raise NotSliceable("repeat_interleave along the rows of a mask over rows x rows")
        return [(x, {d: d for d in dims})]
    ins = _tensor_args(node)
    if name in _BROADCASTS:
        ins = ins[:1]
    found = []
    for t in ins:
        shape = t.meta["val"].shape
        off = nd - len(shape)
        m = {d: d - off for d in dims if d - off >= 0 and not _one(shape[d - off])}
        if name == "repeat":
            for d, td in m.items():
                if sympy.expand(_size(shape[td]) - _size(out.shape[d])) != 0:
                    raise NotSliceable("repeat tiles the rows of a mask over rows x rows")
        found.append((t, m))
    return found


@dataclass(frozen=True)
class Step:
    node: fx.Node
    dims: frozenset[int]                          # the output dimensions taken as the chunk's rows
    inputs: tuple[tuple[fx.Node, frozenset[int], tuple[tuple[int, int], ...]], ...]   # (input, its dims, out->in)


@dataclass(eq=False)
class PairMask:
    """How each Q chunk's rows of a mask over rows x rows are built: ``steps`` in order, from ``leaves`` (values read
    whole: inputs, constants, values built once over every row)."""

    root: fx.Node
    q_dim: int
    steps: list[Step] = field(default_factory=list)
    leaves: set[fx.Node] = field(default_factory=set)

    def by_row(self) -> list[tuple[fx.Node, frozenset[int]]]:
        """The leaves read by query row, with the dimensions that hold the rows."""
        return [(x, dims) for s in self.steps for x, dims, _ in s.inputs if dims and x in self.leaves]

    def one_row_leaves(self) -> bool:
        """Whether every leaf read by query row has the rows in one dimension alone (checking that its slice is the
        same across the rows costs a chunk's rows, not a chunk's rows x keys)."""
        return all(sum(isinstance(s, torch.SymInt) for s in x.meta["val"].shape) == 1 for x, _ in self.by_row())

    def chunk_bytes(self, subs: Callable[[Any], int], chunk: int) -> int:
        """The bytes a chunk's steps allocate (all held at once: a bound), ``subs`` giving a size at the call's rows."""
        total = 0
        for s in self.steps:
            val = s.node.meta["val"]
            if op_name(s.node.target) in _SWAPS | _RESHAPES | {"expand", "broadcast_to"}:
                continue
            n = val.element_size()
            for i, size in enumerate(val.shape):
                n *= min(chunk, subs(size)) if i in s.dims else subs(size)
            total += n
        return total


def pair_mask(root: fx.Node, leaf: Callable[[fx.Node], bool]) -> PairMask:
    """The steps that build ``root``'s chunk rows (its query dimension, second to last, sliced), stopping at the
    values ``leaf`` says are read whole; NotSliceable names an op they cannot take."""
    pm = PairMask(root, root.meta["val"].dim() - 2)
    seen: set[tuple[fx.Node, frozenset[int]]] = set()

    def visit(node: fx.Node, dims: frozenset[int]) -> None:
        if (node, dims) in seen:
            return
        seen.add((node, dims))
        if leaf(node):
            pm.leaves.add(node)
            return
        if not is_pair_op(node):
            raise NotSliceable(f"{op_name(node.target)} on the way to a mask over rows x rows")
        ins = []
        for x, m in input_dims(node, dims):
            xd = frozenset(m.values())
            visit(x, xd)
            ins.append((x, xd, tuple(sorted(m.items()))))
        pm.steps.append(Step(node, dims, tuple(ins)))

    visit(root, frozenset({pm.q_dim}))
    return pm


def _same_rows(v: torch.Tensor, d: int) -> bool:
    """Whether ``v`` is the same at every index of dimension ``d``; False for values not known (a rehearsal's fake
    tensors, meta), which then build every row."""
    if v.device.type == "meta" or isinstance(v, torch._subclasses.fake_tensor.FakeTensor):
        return False
    return bool(v.eq(v.narrow(d, 0, 1)).all())


class PairRows:
    """A chunk's query rows of a mask over rows x rows (``GraphRun``'s source for it, read like host rows): the
    ``PairMask`` steps run on slices of their leaves."""

    def __init__(self, pm: PairMask, env: dict, subs: Callable[[Any], int]):
        self.pm, self.env, self.subs = pm, env, subs

    def part(self, dim: int, start: int, n: int | None) -> torch.Tensor:
        """Query rows [start, start + n) of the mask (``n`` None: all of them). Where every value read by query row
        is the same across those rows (the image rows of a text mask padded over them), one row is built and
        expanded: the attention then reads it as a key mask, with no [chunk, keys] copy."""
        pm = self.pm
        if n is None:   # all of it (a key mask [.., 1, keys] is taken whole)
            dim, start, n = pm.q_dim, 0, self.subs(pm.root.meta["val"].shape[pm.q_dim])
        if dim != pm.q_dim:
            raise ValueError(f"a mask over rows x rows is taken by its query rows (dimension {pm.q_dim}), not {dim}")
        if n > 1 and pm.one_row_leaves() and all(_same_rows(self._slice(self.env[x], dims, start, n), d)
                                                 for x, dims in pm.by_row() for d in dims):
            return self._rows(start, 1).expand(*[n if i == dim else -1 for i in range(pm.root.meta["val"].dim())])
        return self._rows(start, n)

    @staticmethod
    def _slice(v: torch.Tensor, dims, start: int, n: int) -> torch.Tensor:
        for d in sorted(dims):
            v = v.narrow(d, start, n)
        return v

    def _rows(self, start: int, n: int) -> torch.Tensor:
        pm = self.pm
        values: dict[tuple[fx.Node, frozenset[int]], torch.Tensor] = {}

        def value(x: fx.Node, dims: frozenset[int]) -> Any:
            if (x, dims) in values:
                return values[(x, dims)]
            return self._slice(self.env[x], dims, start, n)

        for s in pm.steps:
            values[(s.node, s.dims)] = self._run(s, value, n)
        return values[(pm.root, frozenset({pm.q_dim}))]

    def _run(self, s: Step, value: Callable, n: int) -> torch.Tensor:
        node, name = s.node, op_name(s.node.target)
        got = {x: value(x, dims) for x, dims, _ in s.inputs}
        full = [self.subs(size) for size in node.meta["val"].shape]
        shape = [n if i in s.dims else size for i, size in enumerate(full)]
        x = got[s.inputs[0][0]] if s.inputs else None
        if name in _RESHAPES:
            return x.reshape(shape)
        if name in ("expand", "broadcast_to"):
            return x.expand(shape)
        if name == "repeat":
            return x.repeat([size // (x.shape[i - (len(shape) - x.dim())] if i >= len(shape) - x.dim() else 1)
                             for i, size in enumerate(shape)])

        def arg(a):
            if isinstance(a, fx.Node):
                return got[a] if a in got else (self.subs(a.meta["val"]) if isinstance(
                    a.meta.get("val"), torch.SymInt) else self.env[a])
            return a
        return node.target(*fx.node.map_aggregate(node.args, arg), **fx.node.map_aggregate(node.kwargs, arg))
