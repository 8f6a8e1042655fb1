"""Values computed into a dying operand's storage: a pointwise op whose operand is read by it alone, fresh (not a
view, not a buffer's rows), and laid out as its result is, writes its result over that operand (its ``out=``, bit for
bit the op: each element read before it is written, at its own place). A chain of elementwise ops (a rotary's
``x * cos``, ``rotated * sin``, a gate's product) then holds one value where it held two. ``joins_in_place`` extends the
same rule to a join's slots."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .node_calls import call_node_out

from .analyze import DTYPE_CONVERSIONS, Analysis, Rows, op_name, pointwise
from .direct_writes import has_out
from .row_pieces import is_view


def fresh_result(n: fx.Node, an: Analysis, avoid: set) -> bool:
    """``n`` makes a new tensor of its own on the chunk's rows, contiguous, read by one node alone: an ATen op whose
    result aliases none of its inputs (by its schema), not a view, not one whose value may be something else at run
    time (``avoid``: attentions, values written into buffers, joins)."""
    if n.op != "call_function" or n in avoid or n in an.const or is_view(n) or len(n.users) != 1:
        return False
    if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "aten":
        return False
    returns = n.target._schema.returns
    if len(returns) != 1 or op_name(n.target).endswith("_"):
        return False
    if returns[0].alias_info is not None and not _converted(n):
        return False
    return dense(n) and isinstance(an.rows.get(n), Rows)


def _converted(n: fx.Node) -> bool:
    """A dtype conversion to another dtype (``to``, ``type_as``): its schema may return its input, but not where the
    dtype changes, where it makes a new tensor (``is_view`` takes the same-dtype case)."""
    if op_name(n.target) not in DTYPE_CONVERSIONS or not n.all_input_nodes:
        return False
    val, src = n.meta.get("val"), n.all_input_nodes[0].meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.dtype != src.dtype


def can_write(p: fx.Node, whole: bool = True) -> bool:
    """``p`` is a pointwise ATen op with an ``out=`` overload that is the op (``whole``: its result contiguous)."""
    return (p.op == "call_function" and isinstance(p.target, torch._ops.OpOverload) and p.target.namespace == "aten"
            and pointwise(p.target) and has_out(p) and not op_name(p.target).endswith("_") and (not whole or dense(p)))


def same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return va.dtype == vb.dtype and [str(s) for s in va.shape] == [str(s) for s in vb.shape]


def find_reuse(nodes: list[fx.Node], an: Analysis, keep: set, avoid: set) -> dict[fx.Node, fx.Node]:
    """Per node among ``nodes`` (a phase as it runs) that may write over an operand, that operand."""
    present = set(nodes)
    found: dict[fx.Node, fx.Node] = {}
    taken: set[fx.Node] = set()
    for p in nodes:
        if p in avoid or p.op != "call_function" or not can_write(p):
            continue
        for m in p.args:
            if isinstance(m, fx.Node) and m in present and m not in keep and m not in taken and \
                    list(p.args).count(m) == 1 and fresh_result(m, an, avoid) and same_layout(m, p):
                found[p] = m
                taken.add(m)
                break
    return found


def dense(n: fx.Node) -> bool:
    """``n``'s value is contiguous (as captured)."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    try:
        return bool(val.is_contiguous())
    except Exception:   # a size the symbols cannot decide: left alone
        return False


def takes(v: Any, node: fx.Node) -> bool:
    """At run time: ``v`` (an operand's value) can take ``node``'s result: a contiguous tensor of its dtype (its shape
    the rules above settle; that nothing else holds its memory too: under ``inference_mode`` views are not tracked,
    so it could not be checked here)."""
    return isinstance(v, torch.Tensor) and v.dtype == node.meta["val"].dtype and v.is_contiguous()


def run_over(node: fx.Node, operand: fx.Node, env: dict, call) -> Any:
    """``node`` written over ``operand``'s value where it ``takes`` the result; as usual otherwise."""
    v = env[operand]
    if not takes(v, node):
        return call(node, env)
    return call_node_out(node, env, v)
