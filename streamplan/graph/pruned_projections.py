"""Projections a phase reads only some output features of, computed for those alone.

A fused projection feeds several consumers through column selections (one linear to Q, K, V and the MLP's input,
split along the features). Phase KV needs only K's and V's columns, yet ran the whole linear for every row, and phase
Q ran it again: up to 1.7x the block's GEMM work. Here a linear whose every use in a phase is a
selection of its last dimension (``split_with_sizes``/``chunk`` then ``getitem``, ``slice``, ``narrow``) runs on the
weight's rows for the columns the phase reads (a view: no copy), and each selection is a slice of that. Each output
column is the same dot product either way; the first chunk checks it bit for bit (as fused chains are checked) and a
projection that differs runs whole, noted."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from .analyze import Analysis, op_name

PRUNE_SHARE = 0.85   # pruned only where the phase reads at most this share of the output features
_SPLITS = {"split_with_sizes", "split", "chunk"}


@dataclass(eq=False)
class PrunedProjection:
    """A linear the phase reads columns ``lo``..``hi`` of, through selections ending in ``leaves``."""

    linear: fx.Node
    lo: int
    hi: int
    leaves: dict[fx.Node, tuple[int, int]]   # selection read on by the phase -> its columns of the linear's output
    inner: list[fx.Node]                     # the selections between (graph order), not run
    prelude: list[fx.Node] = field(default_factory=list)   # (``row_pieces.schedule`` reads these: none here)
    post: list[fx.Node] = field(default_factory=list)
    checked: dict = field(default_factory=dict)   # (device type, dtype) -> whether pruned equals whole, bit for bit

    @property
    def marker(self) -> fx.Node:
        return self.linear

    @property
    def nodes(self) -> list[fx.Node]:
        return [self.linear, *self.inner, *self.leaves]

    @property
    def inputs(self) -> list[fx.Node]:
        return list(self.linear.all_input_nodes)


def _last_dim(node: fx.Node, dim) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _selected(user: fx.Node, node: fx.Node, span: tuple[int, int]) -> dict[fx.Node, tuple[int, int]] | None:
    """What ``user`` selects of ``node`` (columns ``span`` of the linear's output) along the last dimension: the
    nodes holding a selection and their columns (a split's ``getitem`` users), or None if ``user`` is not such a
    selection."""
    lo, width = span[0], span[1] - span[0]
    name = op_name(user.target)
    args = list(user.args)
    if name == "slice" and len(args) >= 2 and _last_dim(node, args[1]):
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        end = min(args[3], width) if len(args) > 3 and args[3] is not None else width
        if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or (len(args) > 4 and args[4] != 1):
            return None
        return {user: (lo + start, lo + end)}
    if name == "narrow" and len(args) >= 4 and _last_dim(node, args[1]):
        if not all(isinstance(a, int) for a in args[2:4]) or args[2] < 0:
            return None
        return {user: (lo + args[2], lo + args[2] + args[3])}
    if name in _SPLITS and len(args) >= 3 and _last_dim(node, args[2]):
        if name == "chunk":
            if not isinstance(args[1], int) or width % args[1]:
                return None
            sizes = [width // args[1]] * args[1]
        elif isinstance(args[1], int):
            sizes = [args[1]] * -(-width // args[1])
        else:
            sizes = list(args[1])
        if not all(isinstance(x, int) for x in sizes) or sum(sizes) != width:
            return None
        starts = [lo + sum(sizes[:i]) for i in range(len(sizes))]
        out = {}
        for g in user.users:
            if g.target is not operator.getitem or not isinstance(g.args[1], int):
                return None
            out[g] = (starts[g.args[1]], starts[g.args[1]] + sizes[g.args[1]])
        return out
    return None


def find_prunings(nodes: list[fx.Node], keep: set, an: Analysis) -> list[PrunedProjection]:
    """Linears in ``nodes`` whose uses in this phase all select columns, and read at most ``PRUNE_SHARE`` of them."""
    inside = set(nodes)
    order = {m: i for i, m in enumerate(nodes)}
    found = []
    for n in nodes:
        if op_name(n.target) != "linear" or n in keep or len(n.args) < 2 or not _weights(n):
            continue
        width = int(n.meta["val"].shape[-1])
        leaves: dict[fx.Node, tuple[int, int]] = {}
        inner: list[fx.Node] = []

        def walk(node: fx.Node, span: tuple[int, int]) -> bool:
            users = [u for u in node.users if u in inside]
            if node is not n and (node in keep or not all(_is_selection(u) for u in users)):
                leaves[node] = span   # read by an op that is no selection: the pruned output's columns
                return True
            if node is not n:
                inner.append(node)
            for user in users:
                picked = _selected(user, node, span)
                if picked is None:
                    return False
                if user not in picked:   # a split: its getitems hold the selections
                    inner.append(user)
                if not all(walk(m, cols) for m, cols in picked.items() if m in inside):
                    return False
            return True

        if not walk(n, (0, width)) or not leaves:
            continue
        lo, hi = min(a for a, _ in leaves.values()), max(b for _, b in leaves.values())
        if hi - lo <= PRUNE_SHARE * width:
            found.append(PrunedProjection(n, lo, hi, leaves,
                                          sorted(set(inner), key=lambda m: order.get(m, len(order)))))
    return found


def _weights(n: fx.Node) -> bool:
    """The linear's weight (and bias) are the block's parameters: a weight the graph computes (dequantised, say) is
    left whole."""
    params = [a for a in n.args[1:3] if a is not None]
    return all(isinstance(a, fx.Node) and a.op == "placeholder" for a in params)


def _shapes_only(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or isinstance(t, FakeTensor)


def _is_selection(node: fx.Node) -> bool:
    return node.target is operator.getitem or op_name(node.target) in ("slice", "narrow", *_SPLITS)


def run_pruned(p: PrunedProjection, env: dict, call) -> None:
    """The projection's selections into ``env``: from the pruned linear where the first chunk found it equal to the
    whole one's, else from the whole linear (``call(node, env)`` runs one node)."""
    x = env[p.linear.args[0]]
    key = (x.device.type, x.dtype)
    verdict = p.checked.get(key)
    if verdict is not False:
        w = env[p.linear.args[1]]
        b = env[p.linear.args[2]] if len(p.linear.args) > 2 and p.linear.args[2] is not None else None
        part = F.linear(x, w[p.lo:p.hi], None if b is None else b[p.lo:p.hi])
        pruned = {leaf: part[..., a - p.lo:e - p.lo] for leaf, (a, e) in p.leaves.items()}
        if verdict or _shapes_only(x):   # planning on meta or fake tensors: no values to check
            env.update(pruned)
            return
    for node in (p.linear, *p.inner, *p.leaves):   # whole, as the graph says
        env[node] = call(node, env)
    if verdict is None:
        p.checked[key] = all(torch.equal(pruned[leaf], env[leaf]) for leaf in p.leaves)
        if p.checked[key]:
            for leaf in p.leaves:
                env[leaf] = pruned[leaf]
    for node in (p.linear, *p.inner):
        env.pop(node, None)
