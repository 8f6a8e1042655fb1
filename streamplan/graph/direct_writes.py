"""A chunk's K, V or output written by the op that makes it straight into the whole buffer it goes to (the op's ``out=``
overload), instead of into a chunk tensor of its own that is then copied there: one pass over those rows less, and no
chunk-sized tensor for them. Found on a phase's first chunk, from what that chunk's values turned out to be (the
producer contiguous, the value a view over all of it laid out as the buffer's rows are); anything else keeps the copy.
The written value is then the buffer's rows already, and ``execute.graph_run._write_rows`` sees it and copies
nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .analyze import Analysis, Rows, op_name, pointwise, written_args, writes_in_place
from .row_pieces import storage_node, is_view
from ..specs import address, storage_address


@dataclass(eq=False)
class Into:
    """``node`` writes each chunk's rows into ``buf`` (rows along ``buf``'s ``dim``, ``row`` elements apart), its
    own value shaped ``shape`` with the chunk's rows at ``node_dim``."""

    node: fx.Node
    buf: torch.Tensor
    row: int
    shape: list[int]
    node_dim: int

    def dest(self, a: int, b: int) -> torch.Tensor:
        """The producer's ``out`` for rows [a, b): the buffer's memory of those rows, in the producer's shape."""
        shape = list(self.shape)
        shape[self.node_dim] = b - a
        flat = self.buf.as_strided(((b - a) * self.row,), (1,), self.buf.storage_offset() + a * self.row)
        return flat.view(shape)


def producer(value: fx.Node, an: Analysis) -> fx.Node | None:
    """The op whose storage ``value`` is a view of, where that op has an ``out=`` overload and makes its rows fresh
    (no static rows, no in-place write, not an attention)."""
    p = storage_node(value)
    if p.op != "call_function" or is_view(p) or not isinstance(p.target, torch._ops.OpOverload):
        return None
    r = an.rows.get(p)
    if p.target.namespace != "aten" or not isinstance(r, Rows) or r.pre or r.post:
        return None
    if not _same_math(p) or _written(p) or not has_out(p):
        return None
    return p


def has_out(p: fx.Node) -> bool:
    """Whether ``p``'s op has an ``out=`` overload that is the same call with ``out`` added (``empty_like.out`` takes
    no ``pin_memory``, ``_to_copy.out`` no dtype)."""
    out = getattr(p.target.overloadpacket, "out", None)
    if out is None or [a.name for a in out._schema.arguments if a.is_out] != ["out"]:
        return False
    return [a.name for a in out._schema.arguments if not a.is_out] == [a.name for a in p.target._schema.arguments]


def _same_math(p: fx.Node) -> bool:
    """Ops whose ``out=`` overload computes what the op does, bit for bit: pointwise ops, joins and plain matrix
    products. Not ``linear`` with a bias (its ``out=`` adds the bias after the product, rounded twice; the op adds it
    in the GEMM's epilogue) nor anything not known to."""
    name = op_name(p.target)
    if pointwise(p.target) or name in _PLAIN:
        return True
    return name == "linear" and (len(p.args) < 3 or p.args[2] is None) and p.kwargs.get("bias") is None


_PLAIN = {"cat", "mm", "bmm", "matmul"}


def _written(p: fx.Node) -> bool:
    """Whether ``p``, or a view of it, is written in place anywhere (its value is then more than its op's)."""
    todo, seen = [p], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if writes_in_place(n):
            return True
        todo.extend(u for u in n.users if u.op == "call_function" and (
            is_view(u) or op_name(u.target).endswith("_") or n in written_args(u)))
    return False


@dataclass(frozen=True)
class Made:
    """What a producer made on a phase's first chunk, without holding it (its memory is the plan's to free)."""

    ptr: object   # specs.address
    shape: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    contiguous: bool

    @staticmethod
    def of(t: Any) -> Made | None:
        if not isinstance(t, torch.Tensor):
            return None
        return Made(address(t), tuple(t.shape), t.numel(), t.dtype, t.is_contiguous())


def found(node: fx.Node, an: Analysis, made: Made | None, value: torch.Tensor, buf: torch.Tensor, dim: int,
          total: int) -> Into | None:
    """An ``Into`` where ``value`` (the chunk's rows along ``dim``) is a view over all of what ``node`` ``made``,
    laid out as ``buf``'s rows are, and ``buf`` holds its ``total`` rows one after another."""
    if made is None or not made.contiguous or made.dtype != buf.dtype:
        return None
    rows, row = value.shape[dim], buf.stride(dim)
    outer = all(n == 1 or s < row for i, (n, s) in enumerate(zip(buf.shape, buf.stride())) if i != dim)
    if not outer or buf.numel() != total * row or made.numel != rows * row:
        return None
    if address(value) != made.ptr or any(n != 1 and s != t for n, s, t in
                                           zip(value.shape, value.stride(), buf.stride())):
        return None
    return Into(node, buf, row, list(made.shape), an.rows[node].dim)


def call_into(node: fx.Node, env: dict, out: torch.Tensor, fresh: bool = False) -> Any:
    """``node`` run into ``out``; as usual where one of its inputs lies in ``out``'s storage otherwise than as ``out``
    itself (a donated input's other rows). A pointwise op over an input that is ``out`` exactly reads each element
    before it writes it. ``fresh``: ``out`` is a buffer this chunk made, which only its own writers read."""
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    if fresh:
        return node.target.overloadpacket.out(*args, **kwargs, out=out)
    storage = storage_address(out)
    ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(storage_address(t) == storage and not (pointwise(node.target) and same_view(t, out))
           for t in ins):
        return node.target(*args, **kwargs)
    return node.target.overloadpacket.out(*args, **kwargs, out=out)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same elements of the same memory, laid out alike."""
    return address(a) == address(b) and a.shape == b.shape and a.stride() == b.stride()
