"""Joins built in place: a ``cat`` along the features whose inputs include values made by pointwise ops and read by the
join alone is built by those ops writing straight into their slices of the joined buffer (their ``out=``, which is the
op bit for bit); the other inputs are copied into theirs, and the join moves nothing again. One pass less over those
values, and never a tensor of them beside the join. A rotary embedding's ``cat((-x2, x1))`` and
``cat((rotated, passed))`` are the common case. Where the join's own value goes into a buffer (``direct_writes``), its
slots are that buffer's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .analyze import Analysis, Rows
from .direct_writes import call_into, same_view
from .row_pieces import is_view
from .in_place import can_write, dense, fresh_result, same_layout

aten = torch.ops.aten


@dataclass(eq=False)
class Join:
    node: fx.Node              # the cat
    dim: int                   # the joined dimension, counted from the front
    inputs: list[fx.Node]
    offsets: list[int]         # where each input starts along ``dim``
    slots: set[fx.Node]        # inputs whose op writes into its slice
    feeds: dict[fx.Node, fx.Node]   # a slot's operand made in the slot's slice, which the slot then computes over

    def part(self, buf: torch.Tensor, m: fx.Node) -> torch.Tensor:
        i = self.inputs.index(self.feeds.get(m, m))
        return buf.narrow(self.dim, self.offsets[i], self.offsets[i + 1] - self.offsets[i])

    def new_buffer(self, args: list) -> torch.Tensor:
        """The joined value's buffer (contiguous, as the cat's is), shaped from a slot's operands."""
        ts = [t for t in args if isinstance(t, torch.Tensor)]
        shape = list(torch.broadcast_shapes(*(t.shape for t in ts)))
        shape[self.dim] = self.offsets[-1]
        return torch.empty(shape, dtype=self.node.meta["val"].dtype, device=ts[0].device)


def find_joins(nodes: list[fx.Node], an: Analysis) -> dict[fx.Node, Join]:
    """Per join, per slot and per feed among ``nodes`` (as a phase runs them), its ``Join``."""
    present = set(nodes)
    found: dict[fx.Node, Join] = {}
    for n in nodes:
        j = _join(n, an, present)
        if j is not None:
            found[n] = j
            found.update(dict.fromkeys([*j.slots, *j.feeds], j))
    return found


def _join(c: fx.Node, an: Analysis, present: set) -> Join | None:
    if c.op != "call_function" or c.target is not aten.cat.default or c in an.const:
        return None
    ins, val = c.args[0], c.meta.get("val")
    dim = c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0)
    r = an.rows.get(c)
    if not isinstance(val, torch.Tensor) or not isinstance(r, Rows) or not isinstance(dim, int):
        return None
    dim %= val.dim()
    if dim == r.dim or not dense(c) or len(set(ins)) != len(ins) \
            or not all(isinstance(m, fx.Node) for m in ins):
        return None
    offsets = [0]
    for m in ins:
        v = m.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() != val.dim() or v.dtype != val.dtype \
                or isinstance(v.shape[dim], torch.SymInt):
            return None
        offsets.append(offsets[-1] + int(v.shape[dim]))
    slots = {m for m in ins if _slot(m, c, an, present)}
    feeds = {}
    for p in slots:   # an operand read by the slot alone and shaped as its result: made in the slice already
        m = next((m for m in p.args if isinstance(m, fx.Node) and m in present and list(p.args).count(m) == 1
                  and fresh_result(m, an, set()) and can_write(m) and same_layout(m, p)), None)
        if m is not None:
            feeds[m] = p
    return Join(c, dim, list(ins), offsets, slots, feeds) if slots else None


def _slot(m: fx.Node, c: fx.Node, an: Analysis, present: set) -> bool:
    """``m`` can write into its slice: a fresh pointwise value on the chunk's rows, read by the join alone."""
    if m not in present or m in an.const or is_view(m) or list(m.users) != [c]:
        return False
    return can_write(m, whole=False) and isinstance(an.rows.get(m), Rows)


def run_join(j: Join, node: fx.Node, env: dict, built: dict[fx.Node, torch.Tensor],
             into: dict[fx.Node, torch.Tensor] | None) -> torch.Tensor | None:
    """``node`` (the join or one of its slots) on one chunk; ``built`` holds the chunk's joined buffers so far. None:
    the join itself where no slot ran on this chunk (it runs as usual)."""
    if node is not j.node:   # a slot or a feed: writes into its slice of the buffer, made by the first of them to run
        buf = built.get(j.node)
        if buf is None:
            buf = (into or {}).get(j.node)
            if buf is None:
                buf = j.new_buffer(fx.node.map_arg(node.args, lambda m: env[m]))
            built[j.node] = buf
        return call_into(node, env, j.part(buf, node), fresh=not into or j.node not in into)
    buf = built.pop(node, None)
    if buf is None:
        return None
    for m in j.inputs:   # what is not in place yet (a view's values, a slot that could not write in place)
        dst, v = j.part(buf, m), env[m]
        if not same_view(v, dst):
            dst.copy_(v)
    return buf
