"""Sliced MLPs in a captured graph (tier L2): a linear -> elementwise -> linear region found in the graph holds no more
than a slice of its hidden features' worth of hidden values at a time, so the chunk never holds all of them at once:
the whole MLP on row pieces of the chunk, or every row a slice of hidden features at a time (``SPLIT``)."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from .analyze import Analysis, Rows, op_name, pointwise
from .row_pieces import is_view
from .in_place import can_write, same_layout, takes

aten = torch.ops.aten
_PASSING = {"_to_copy", "to", "type_as", "clone", "dropout", "alias", "contiguous", "detach"}
_SPLITS = {"chunk", "split", "split_with_sizes"}


@dataclass(eq=False)
class MLPRegion:
    x: fx.Node                                 # the rows every entry projects
    entries: dict[fx.Node, int]                # entry linear -> how many ffn-wide parts its output holds
    inner: list[fx.Node]                       # the elementwise nodes between, graph order
    exit: fx.Node                              # the linear that contracts the hidden features
    ffn: int
    parts: dict[fx.Node, int] = field(default_factory=dict)   # every region node -> ffn-wide parts in its last dim
    _dead: dict | None = field(default=None, repr=False)

    @property
    def nodes(self) -> set[fx.Node]:
        return set(self.entries) | set(self.inner)

    @functools.cached_property
    def over(self) -> dict[fx.Node, fx.Node]:
        """Inner pointwise ops that write over an operand dying with them (``in_place``'s rule inside a region): an
        entry's output, a fresh inner value, or an entry's part taken by its split (the parts are disjoint)."""
        found: dict[fx.Node, fx.Node] = {}
        for n in self.inner:
            if not can_write(n):
                continue
            for m in n.args:
                if isinstance(m, fx.Node) and m not in found.values() and len(m.users) == 1 \
                        and list(n.args).count(m) == 1 and self._exclusive(m) and same_layout(m, n):
                    found[n] = m
                    break
        return found

    def joins_parts(self, e: fx.Node) -> bool:
        """Whether a fused entry's parts are ever joined (a use other than the split that takes them apart)."""
        return self.entries.get(e, 1) > 1 and any(not splits_parts(u, self.entries[e], self.ffn) for u in e.users)

    def _exclusive(self, m: fx.Node) -> bool:
        if m in self.entries:
            return self.entries[m] == 1
        if m not in self.parts:
            return False
        if m.target is operator.getitem:   # a fused entry's part, as the split that takes them apart gives it
            split = m.args[0]
            e = split.args[0] if split.args else None
            return e in self.entries and list(e.users) == [split] and splits_parts(split, self.entries[e], self.ffn)
        return not is_view(m)

    @property
    def sized(self) -> bool:
        """Whether an inner node reads a size from the graph (which may count the chunk's rows, not a piece's)."""
        return any(isinstance(m.meta.get("val"), torch.SymInt) for n in self.inner for m in n.all_input_nodes)

    def dead_after(self) -> dict[fx.Node, list[fx.Node]]:
        """Per inner node, the region values it uses for the last time (what the exit reads stays): a slice frees
        them as it goes, as the memory model assumes."""
        if self._dead is None:
            last: dict[fx.Node, fx.Node] = {}
            for n in self.inner:
                for m in n.all_input_nodes:
                    if m in self.entries or m in self.parts:
                        last[m] = n
            keep = set(self.exit.all_input_nodes)
            self._dead = {}
            for m, n in last.items():
                if m not in keep:
                    self._dead.setdefault(n, []).append(m)
        return self._dead


def _width(node) -> int | None:
    """The last dimension of a node's value (or of a tensor), when it is a plain number."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else node
    if isinstance(val, torch.Tensor) and val.dim():
        size = val.shape[-1]
        return None if isinstance(size, torch.SymInt) else int(size)
    return None


def _param_linear(node: fx.Node, an: Analysis) -> bool:
    if node.op != "call_function" or node.target is not aten.linear.default:
        return False
    w = node.args[1]
    return isinstance(w, fx.Node) and w.op == "placeholder" and isinstance(an.rows.get(node.args[0]), Rows)


def find_regions(nodes: list[fx.Node], an: Analysis) -> list[MLPRegion]:
    """Every MLP region among ``nodes`` (a phase's node list) that can be feature-sliced."""
    order = {n: i for i, n in enumerate(nodes)}
    regions, taken = [], set()
    for exit_ in nodes:
        if not _param_linear(exit_, an) or exit_ in taken:
            continue
        region = _region(exit_, order, an)
        if region is not None and not (region.nodes & taken):
            regions.append(region)
            taken |= region.nodes | {region.exit}
    return regions


def _region(exit_: fx.Node, order: dict, an: Analysis) -> MLPRegion | None:
    ffn = _width(exit_.args[0])
    if not ffn or ffn < 2:
        return None
    # walk back from the exit's input through elementwise ops to linears on one x
    inner, entries, todo, seen = [], {}, [exit_.args[0]], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in order:
            return None
        if _param_linear(n, an):
            w = _width(n)
            if w is None or w % ffn:
                return None
            entries[n] = w // ffn
            continue
        name = op_name(n.target)
        if n.target is operator.getitem:
            todo.append(n.args[0])
        elif name in _SPLITS:
            if (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) not in (-1, _ndim(n) - 1):
                return None
            todo.append(n.args[0])
        elif name in _PASSING or pointwise(n.target):
            for m in n.all_input_nodes:
                if isinstance(an.rows.get(m), Rows) or m in order:
                    todo.append(m)
        else:
            return None
        inner.append(n)
    xs = {e.args[0] for e in entries}
    if len(xs) != 1 or not entries:
        return None
    region = MLPRegion(xs.pop(), entries, sorted(inner, key=order.get), exit_, ffn)
    members = region.nodes | {exit_}
    for n in region.nodes:   # nothing outside uses the hidden features
        if any(u not in members for u in n.users):
            return None
    return region if _assign_parts(region, an) else None


def _ndim(n: fx.Node) -> int:
    val = n.args[0].meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _assign_parts(region: MLPRegion, an: Analysis) -> bool:
    parts = dict(region.entries)
    for n in region.inner:
        name = op_name(n.target)
        if n.target is operator.getitem:
            parts[n] = 1 if op_name(n.args[0].target) in _SPLITS else parts.get(n.args[0], 0)
            continue
        src = [parts[m] for m in n.all_input_nodes if m in parts]
        if not src or len(set(src)) != 1:
            return False
        if name in _SPLITS:
            pieces = n.meta.get("val")
            if not isinstance(pieces, (tuple, list)) or len(pieces) != src[0] or any(
                    _width(p) != region.ffn for p in pieces):
                return False
            parts[n] = src[0]
            continue
        if _width(n) != src[0] * region.ffn:
            return False
        for m in n.all_input_nodes:   # other operands: broadcast along the features, or per-feature constants
            if m in parts:
                continue
            if isinstance(an.rows.get(m), Rows) or m not in an.const and m.op != "placeholder":
                return False
            w = _width(m)
            if w not in (None, 1, src[0] * region.ffn):
                return False
        parts[n] = src[0]
    region.parts = parts
    return True


def _feature_index(ffn: int, parts: int, a: int, b: int, device) -> torch.Tensor | slice:
    if parts == 1:
        return slice(a, b)
    return torch.cat([torch.arange(j * ffn + a, j * ffn + b, device=device) for j in range(parts)])


def _take(t: torch.Tensor, index, dim: int = -1) -> torch.Tensor:
    if isinstance(index, slice):
        return t.narrow(dim, index.start, index.stop - index.start)
    return t.index_select(dim, index)


# How a region keeps to a slice's worth of hidden values: "rows" runs the whole MLP on as many row pieces of the
# chunk as there would be slices (row-local: each output row is the stock GEMMs' row, no accumulation); "features"
# runs every row a slice of hidden features at a time, accumulating the exit's partial products (one rounding per
# slice). Rows where the region reads no size that counts the rows; features otherwise.
SPLIT = "rows"


def row_dim(region: MLPRegion, an: Analysis) -> int | None:
    """The dimension of the region input's rows where the region can run on row pieces (``SPLIT``), else None: the
    region reads a size, or its input has static rows."""
    r = an.rows.get(region.x)
    if SPLIT != "rows" or region.sized or not isinstance(r, Rows) or r.pre or r.post:
        return None
    return r.dim


def run_region(region: MLPRegion, env: dict, ffn_slice: int, rows_at: int | None = None) -> torch.Tensor:
    """The exit linear's value with no more than ``ffn_slice`` hidden features' worth of hidden values at a time: on
    row pieces along ``rows_at`` (``row_dim``), else a slice of hidden features at a time."""
    if rows_at is not None:
        return _by_rows(region, env, ffn_slice, rows_at)
    x = env[region.x]
    w_out = env[region.exit.args[1]]
    b_out = env[region.exit.args[2]] if len(region.exit.args) > 2 and region.exit.args[2] is not None else None
    out = None
    for a in range(0, region.ffn, ffn_slice):
        b = min(a + ffn_slice, region.ffn)
        h = _hidden(region, env, x, a, b)
        if out is None:
            out = F.linear(h, w_out[:, a:b], b_out)
        elif type(w_out) not in (torch.Tensor, torch.nn.Parameter):   # a weight subclass: its own linear
            out.add_(F.linear(h, w_out[:, a:b]))
        else:   # accumulated by the GEMM itself (beta = 1): no separate add, one rounding per slice
            out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), w_out[:, a:b].t())
        del h
    return out


def _by_rows(region: MLPRegion, env: dict, ffn_slice: int, dim: int) -> torch.Tensor:
    """The region on row pieces of the chunk, as many as ``ffn_slice`` makes slices, each written into its rows of
    the output (by the exit's own GEMM where it has no bias: ``linear``'s ``out=`` is then the op)."""
    x = env[region.x]
    w_out = env[region.exit.args[1]]
    b_out = env[region.exit.args[2]] if len(region.exit.args) > 2 and region.exit.args[2] is not None else None
    rows = x.shape[dim]
    step = -(-rows // -(-region.ffn // ffn_slice))
    direct = b_out is None and type(w_out) in (torch.Tensor, torch.nn.Parameter)
    out = None
    for s in range(0, rows, step):
        piece = x.narrow(dim, s, min(step, rows - s))
        h = _hidden(region, env, piece, 0, region.ffn)
        if out is None:
            shape = list(piece.shape[:-1]) + [w_out.shape[0]]
            shape[dim] = rows
            out = piece.new_empty(shape, dtype=h.dtype)
        dst = out.narrow(dim, s, piece.shape[dim])
        if direct and dst.is_contiguous():
            torch.ops.aten.linear.out(h, w_out, None, out=dst)
        else:
            dst.copy_(F.linear(h, w_out, b_out))
        del h
    return out


def _hidden(region: MLPRegion, env: dict, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The exit's input for hidden features [a, b) of the rows ``x``."""
    local: dict[fx.Node, object] = {}
    dead = region.dead_after()
    for e, parts in region.entries.items():
        local[e] = _entry_slice(x, env[e.args[1]], env[e.args[2]] if len(e.args) > 2 and e.args[2] is not None
                                else None, region.ffn, parts, a, b)
    whole = a == 0 and b == region.ffn
    for n in region.inner:
        parts = region.parts[n]
        pieces = _parts_split(n, local, region.ffn)
        if pieces is not None:   # a fused gate/up split: each part its own linear's output already
            local[n] = pieces
            del pieces
            for m in dead.get(n, ()):
                local.pop(m, None)
            continue

        def arg(m, parts=parts):
            if m in local:
                v = local[m]
                return torch.cat(v, -1) if isinstance(v, _Parts) else v
            v = env[m]
            if not whole and isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == parts * region.ffn \
                    and v.shape[-1] > 1:
                return _take(v, _feature_index(region.ffn, parts, a, b, v.device))
            return v

        args = fx.node.map_arg(n.args, arg)
        kwargs = fx.node.map_arg(n.kwargs, arg)
        name = op_name(n.target)
        if name == "split_with_sizes":
            args = (args[0], [b - a] * len(args[1]), *args[2:])
        elif name == "split":
            args = (args[0], b - a, *args[2:])
        if n.target is operator.getitem:
            local[n] = args[0][args[1]]
        elif n in region.over and takes(local.get(region.over[n]), n):
            local[n] = n.target.overloadpacket.out(*args, **kwargs, out=local[region.over[n]])
        else:
            local[n] = n.target(*args, **kwargs)
        del args, kwargs
        for m in dead.get(n, ()):
            local.pop(m, None)
    return local[region.exit.args[0]]


class _Parts(list):
    """A fused entry linear's slice kept as one output per part: the split that follows takes them as they are (no
    join and split again); any other use joins them."""


def _parts_split(n: fx.Node, local: dict, ffn: int) -> tuple | None:
    """The parts themselves where ``n`` splits a ``_Parts`` value's last dimension into its parts of ``ffn`` features
    each (as captured), else None."""
    src = local.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if not isinstance(src, _Parts):
        return None
    return tuple(src) if splits_parts(n, len(src), ffn) else None


def splits_parts(n: fx.Node, parts: int, ffn: int) -> bool:
    """``n`` splits its input's last dimension into ``parts`` parts of ``ffn`` features each."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    name = op_name(n.target)
    val = n.args[0].meta.get("val")
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    if val is None or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return False
    return (name == "chunk" and n.args[1] == parts) or (name == "split" and n.args[1] == ffn) or (
        name == "split_with_sizes" and list(n.args[1]) == [ffn] * parts)


def _entry_slice(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ffn: int, parts: int, a: int,
                 b: int) -> torch.Tensor | _Parts:
    """An entry linear over hidden features [a:b) of each of its ``parts`` (a fused gate/up weight holds two): one
    linear per part on a row range of the weight (a view, never a gathered copy of the weight)."""
    if parts == 1 and a == 0 and b == ffn:   # all of it (a row piece): the weight as it is, whatever its type
        return F.linear(x, w, bias)
    if parts == 1:
        return F.linear(x, w[a:b], None if bias is None else bias[a:b])
    return _Parts(F.linear(x, w[j * ffn + a:j * ffn + b], None if bias is None else bias[j * ffn + a:j * ffn + b])
                  for j in range(parts))
