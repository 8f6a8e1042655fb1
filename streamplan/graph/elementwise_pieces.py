"""An element-wise result read only in pieces along one dimension (a per-row modulation table,
``table + temb.reshape(B, N, 6, D)`` then ``unbind(2)``: six shifts, scales and gates of every row) is rewritten as
one element-wise op per piece, each placed where its piece is first read. Stock holds the whole table from the block's
first line to its last; per piece, each slice lives from its first use to its last. Exact: the same op on the same
elements; the pieces are only read by element-wise ops, whose results do not depend on their operands' strides."""
from __future__ import annotations

import operator

import torch
from torch import fx

from .analyze import VIEW_OPS, op_name
from .graph_edits import erase_unused, graph_order

_BINARY = {"add", "sub", "mul", "div"}
_SPLITS = {"unbind", "chunk", "split", "split_with_sizes"}
# what a piece may be read by (through views): element-wise ops, which compute each element from its operands alone
_READERS = _BINARY | {"addcmul", "addcdiv", "neg", "sigmoid", "tanh", "exp", "rsub", "where", "lerp", "maximum",
                      "minimum", "clamp", "to", "_to_copy"}


def split_read_in_pieces(graph: fx.Graph) -> int:
    """Rewrite every element-wise result read only in pieces (see the module); returns how many."""
    done = 0
    for split in [n for n in graph.nodes if n.op == "call_function" and op_name(n.target) in _SPLITS]:
        x = split.args[0]
        pieces = _pieces(split, x)
        if pieces is None:
            continue
        order = graph_order(graph)   # the readers are nodes already there: one index serves every piece
        for item, (dim, start, length, keep) in pieces.items():
            if not item.users:
                continue
            first = min(item.users, key=order)
            with graph.inserting_before(first):
                args = [_piece(graph, a, x, dim, start, length, keep) for a in x.args]
                new = graph.call_function(x.target, tuple(args), dict(x.kwargs))
                new.meta = {**x.meta, "val": item.meta["val"].new_empty(item.meta["val"].shape,
                                                                         dtype=item.meta["val"].dtype)}
            item.replace_all_uses_with(new)
        erase_unused(graph, [*split.users, split, x])
        done += 1
    if done:
        graph.lint()
    return done


def _pieces(split: fx.Node, x) -> dict[fx.Node, tuple[int, int, int, bool]] | None:
    """Each piece's getitem -> (dim, start, length, dim kept), where ``x`` is a binary element-wise op read by this
    split alone, every operand either whole along ``dim`` or broadcast over it, and every piece read only by
    element-wise ops; else None."""
    if not isinstance(x, fx.Node) or x.op != "call_function" or op_name(x.target) not in _BINARY \
            or len(x.users) != 1 or x.kwargs:
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    name = op_name(split.target)
    dim = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim", 0)
    if name != "unbind":
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return None
    dim = dim % val.dim()
    size = val.shape[dim]
    if not isinstance(size, int):
        return None
    for a in x.args:
        if isinstance(a, fx.Node):
            av = a.meta.get("val")
            if not isinstance(av, torch.Tensor) or av.dim() != val.dim() or av.shape[dim] not in (1, size):
                return None
        elif not isinstance(a, (int, float)):
            return None
    bounds = _bounds(split, name, size)
    if bounds is None:
        return None
    out = {}
    for item in split.users:
        if item.target is not operator.getitem or not isinstance(item.args[1], int) or not _read_elementwise(item):
            return None
        start, length = bounds[item.args[1]]
        out[item] = (dim, start, length, name != "unbind")
    return out


def _bounds(split: fx.Node, name: str, size: int) -> list[tuple[int, int]] | None:
    if name == "unbind":
        return [(i, 1) for i in range(size)]
    arg = split.args[1]
    if name == "chunk":
        if not isinstance(arg, int) or arg <= 0:
            return None
        step = -(-size // arg)
        lengths = [min(step, size - s) for s in range(0, size, step)]
    elif isinstance(arg, int):
        lengths = [min(arg, size - s) for s in range(0, size, arg)]
    elif isinstance(arg, (list, tuple)) and all(isinstance(v, int) for v in arg) and sum(arg) == size:
        lengths = list(arg)
    else:
        return None
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(starts, lengths))


def _read_elementwise(node: fx.Node, depth: int = 3) -> bool:
    """Whether every read of ``node`` (through views) is an element-wise op."""
    for u in node.users:
        name = op_name(u.target)
        if name in VIEW_OPS and depth > 0:
            if not _read_elementwise(u, depth - 1):
                return False
        elif name not in _READERS:
            return False
    return True


def _piece(graph: fx.Graph, a, x: fx.Node, dim: int, start: int, length: int, keep: bool):
    """Operand ``a`` of ``x`` at the piece: its slice along ``dim``, or where it broadcasts over ``dim`` its one
    index (dropped with the dim where the piece drops it)."""
    if not isinstance(a, fx.Node):
        return a
    av = a.meta["val"]
    broadcast = av.shape[dim] == 1 and x.meta["val"].shape[dim] != 1
    if keep:
        if broadcast:
            return a
        node = graph.call_function(torch.ops.aten.slice.Tensor, (a, dim, start, start + length))
        node.meta = {"val": av.narrow(dim, start, length)}
        return node
    node = graph.call_function(torch.ops.aten.select.int, (a, dim, 0 if broadcast else start))
    node.meta = {"val": av.select(dim, 0 if broadcast else start)}
    return node

