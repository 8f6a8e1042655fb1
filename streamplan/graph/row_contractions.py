"""Contractions over every row: an op whose output has no rows but whose inputs do (linear attention's ``V^T K``
state, a sum over the rows). No chunk can compute it alone, but it is computed as an attention's K and V are: in
phase KV, its inputs built chunk by chunk into whole buffers, then the op run once on them, as stock runs it (the
same op on the same values: the same result); every Q chunk then reads its small result as it reads an input.

Exact only where its inputs are phase-KV values: built from the block's inputs by row-local ops, never from an
attention's output, another contraction, or an op that reads a halo of rows (phase KV's chunks are not widened).
Otherwise the block stays stock, named."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx

from .op_names import REDUCE_OPS, NotRowLocal

NOT_HANDLED = object()   # the op is none of this module's: ``analyze`` classifies it as before


@dataclass(eq=False)
class RowContraction:
    """An op contracting over every row: ``node`` (its output without rows) and its ``inputs`` with rows."""

    node: fx.Node
    inputs: list[fx.Node]


_CONTRACTING_MATMULS = {"matmul", "bmm", "mm"}


def contraction_or_row_local(an: Any, node: fx.Node, name: str, args: dict, inputs: list, val: Any) -> Any:
    """For a matmul, a reduction or a pad: its rows (``Rows`` or None, a contraction recorded in
    ``an.contractions``), or ``NOT_HANDLED`` where ``analyze``'s own rules apply; raises ``NotRowLocal``."""
    if name in ("pad", "constant_pad_nd"):
        return _pad(an, node, name, args, inputs, val)
    if name in _CONTRACTING_MATMULS:
        a, b = args.get("self", args.get("input")), args.get("other", args.get("mat2"))
        ra, rb = an.rows.get(a), an.rows.get(b)
        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and b in dict(inputs):
            bv = b.meta["val"]
            if a not in dict(inputs):   # a small state read by each row: rows of ``b``'s last dimension, kept
                if bv.dim() < 2 or rb.dim != bv.dim() - 1:
                    raise NotRowLocal(f"{name} contracts over the rows of its second operand alone")
                out = an.out_rows(node, val, rb.pre, rb.post)
                if out is None or out.dim != val.dim() - 1:
                    raise NotRowLocal(f"{name} moves the rows")
                return out
            av = a.meta["val"]
            if ra.dim == av.dim() - 1 and bv.dim() >= 2 and rb.dim == bv.dim() - 2:
                return _record(an, node, name, [a, b], val)
            raise NotRowLocal(f"{name} of two values with rows other than a contraction over them")
        return NOT_HANDLED
    if name in REDUCE_OPS and inputs:
        x_node, x = inputs[0]
        dims = args.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if len(inputs) == 1 and dims and x.dim in {an.norm_dim(d, x_node.meta["val"].dim()) for d in dims}:
            return _record(an, node, name, [x_node], val)
    return NOT_HANDLED


def custom_contraction(an: Any, node: fx.Node, name: str, inputs: list, val: Any) -> None:
    """A custom op declared a contraction over every row (``registries.register_row_contraction_op``): recorded, its
    output without rows; raises ``NotRowLocal`` where an input's rows are joined with static rows or a grid."""
    return _record(an, node, name, [n for n, _ in inputs], val)


def _record(an: Any, node: fx.Node, name: str, operands: list[fx.Node], val: Any) -> None:
    import torch
    if not isinstance(val, torch.Tensor) or an.row_dims(val):
        raise NotRowLocal(f"{name} over the rows gives a value with rows")
    for n in operands:
        r = an.rows[n]
        if r.pre or r.post or r.unit != 1:
            raise NotRowLocal(f"{name} over rows joined with static rows or laid out as a grid")
    an.contractions.append(RowContraction(node, operands))
    return None


def _pad(an: Any, node: fx.Node, name: str, args: dict, inputs: list, val: Any) -> Any:
    """Padding of dimensions other than the rows is row-local; padding the rows is not."""
    if not inputs:
        return NOT_HANDLED
    x_node, x = inputs[0]
    pad = list(args.get("pad") or [])
    ndim = x_node.meta["val"].dim()
    at = ndim - 1 - x.dim   # pads are given last dimension first, (before, after) each
    if len(inputs) > 1 or x_node is not args.get("self", args.get("input")) or \
            any(not isinstance(p, int) for p in pad) or (2 * at + 1 < len(pad) and (pad[2 * at] or pad[2 * at + 1])):
        raise NotRowLocal(f"{name} along the rows")
    return an.out_rows(node, val, x.pre, x.post)
