"""The phases of a captured block, worked out once per capture: which nodes phase KV runs for each global attention
(its K and V with the writes into their storage), which nodes phase Q runs, which op may write each K, V or output
straight into its buffer, and what each phase computes in place (joins built by their slots, results over dying
operands). The executor (``streamplan.execute.graph_run``) and the memory model (``memory``) both read it from here."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .analyze import FRESH_BUFFERS, VIEW_OPS, Analysis, Rows, op_name, written_args, writes_in_place
from .direct_writes import producer
from .export import Captured
from .in_place import find_reuse
from .joins_in_place import Join, find_joins
from .reduced_attentions import tail_nodes
from .row_pieces import dynamic_rows, is_view, storage_node


@dataclass(eq=False)
class Phases:
    """The node lists each phase runs (constants excluded) and what each keeps to the end; worked out once per
    capture with what the runs may do besides running them (``producers``, ``last``, ``done``)."""

    const: list[fx.Node]
    kv: list[list[fx.Node]]          # per global attention, in graph order
    q: list[fx.Node]
    writes: dict = field(default_factory=dict)   # in-place writes each node depends on (``writes_before``)
    producers: dict = field(default_factory=dict)  # K, V or output -> the op that may write it into its buffer
    last: set = field(default_factory=set)       # outputs whose producer only views follow: may write a donated input
    done: dict = field(default_factory=dict)     # ``in_place``'s and ``find_chains``' answers per phase and keep
    tail: list = field(default_factory=list)     # what reads a reduced attention's output: run once after phase Q
    held_consts: set = field(default_factory=set)  # values without rows that a phase or an output reads: kept
    # through the call (every other value of the constant phase is let go once the constants are computed)


def writes_before(order: list[fx.Node], base: dict[fx.Node, fx.Node] | None = None) -> dict[fx.Node, set[fx.Node]]:
    """For every node, the in-place writes before it into storage it reads (``copy_`` into slices of an
    ``empty_like``): data flow the graph's edges do not show, but a phase that needs the value needs the writes.
    ``base`` (filled when given) maps each view or write to the node whose storage it uses."""
    base = {} if base is None else base
    writes: dict[fx.Node, list[fx.Node]] = {}
    extra: dict[fx.Node, set[fx.Node]] = {}
    for n in order:
        ins = n.all_input_nodes
        name = op_name(n.target)
        reads = {base.get(m, m) for m in ins}
        extra[n] = {w for b in reads for w in writes.get(b, [])}
        if ins and (name in VIEW_OPS or n.target is operator.getitem or name.endswith("_")):
            base[n] = base.get(ins[0], ins[0])
        if name.endswith("_") and ins:   # into every argument it writes (by its schema), else its first
            for w in written_args(n) or ins[:1]:
                writes.setdefault(base.get(w, w), []).append(n)
    return extra


def ancestors(roots: list[fx.Node], stop: set[fx.Node], extra: dict[fx.Node, set[fx.Node]],
               replaced: dict[fx.Node, list[fx.Node]] | None = None) -> set[fx.Node]:
    """What ``roots`` need; a node in ``replaced`` needs only the nodes given there (a global attention in phase Q
    reads its Q chunk alone: K and V come from phase KV's buffers)."""
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    replaced = replaced or {}
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        if n in replaced:
            todo.extend(replaced[n])
            continue
        todo.extend(n.all_input_nodes)
        todo.extend(extra.get(n, ()))
    return seen


def _fills_new_buffer(n: fx.Node) -> bool:
    """``n`` writes in place into (views of) a buffer an allocation op made."""
    if n.op != "call_function" or n.target is operator.getitem:
        return False
    bases = [storage_node(w) for w in written_args(n)]
    return bool(bases) and all(b.op == "call_function" and isinstance(b.target, torch._ops.OpOverload)
                               and op_name(b.target) in FRESH_BUFFERS for b in bases)


def sunk(nodes: list[fx.Node], an: Analysis) -> list[fx.Node]:
    """``nodes`` with each value made as late as it may be: just before its first reader, where everything it reads
    is read there or later anyway (so nothing lives longer) and nothing between writes in place. A gated residual's
    ``x.float() + y.float() * gate`` then converts ``x`` after the product, not beside both: one fp32 row less at its
    worst moment. The same ops on the same values: exact."""
    order = list(nodes)
    pos = {m: i for i, m in enumerate(order)}
    attentions = {a.node for a in [*an.attentions, *an.reduced]}
    for n in reversed(nodes):
        if n in attentions or not _sinkable(n, an):
            continue
        here = pos[n]
        first = min((pos[u] for u in n.users if u in pos), default=None)
        if first is None or first <= here + 1 or any(writes_in_place(m) for m in order[here + 1:first]):
            continue
        if all(_alive_at(m, n, first, pos, an) for m in n.all_input_nodes):
            order.insert(first - 1, order.pop(here))
            pos = {m: i for i, m in enumerate(order)}   # (moves are few: the positions again only after one)
    return order


def _sinkable(n: fx.Node, an: Analysis) -> bool:
    """A value of its own made by a pure, deterministic op: no view (it costs nothing where it is), no fresh buffer
    (the writes after it fill it)."""
    if n.op != "call_function" or writes_in_place(n) or is_view(n) or n in an.const:
        return False
    name = op_name(n.target) if isinstance(n.target, torch._ops.OpOverload) else ""
    return bool(name) and name not in FRESH_BUFFERS and not any(w in name for w in ("rand", "bernoulli", "dropout"))


def _alive_at(m: fx.Node, n: fx.Node, at: int, pos: dict, an: Analysis) -> bool:
    """``m`` is alive at position ``at`` whether or not ``n`` reads it there: held whole (a weight, a constant),
    no tensor, or read again at ``at`` or later."""
    if m.op == "get_attr" or m in an.const or not isinstance(m.meta.get("val"), torch.Tensor):
        return True
    return any(u is not n and pos.get(u, -1) >= at for u in m.users)


def phases_of(cap: Captured, an: Analysis) -> Phases:
    order = [n for n in cap.graph.nodes if n.op == "call_function" and n not in an.ignored]
    const = [n for n in order if n in an.const]
    stop = set(an.const) | an.read_as_inputs | {n for n in cap.graph.nodes if n.op == "placeholder"}
    base: dict[fx.Node, fx.Node] = {}
    output = next(n for n in cap.graph.nodes if n.op == "output")
    extra = writes_before(order + [output], base)
    kv = []
    for att in an.attentions:
        # K and V as the attention reads them: with the writes into their storage between their creation and the
        # attention (CogVideoX's rotary copied into the image rows of K after its norm)
        kv_bases = {base.get(att.k, att.k), base.get(att.v, att.v)}
        late = [w for w in extra.get(att.node, ()) if base.get(w) in kv_bases]
        need = ancestors([att.k, att.v, *late], stop, extra)
        # K's chain first, then what V alone needs: V's projection is not held through K's norm and rotary
        first = ancestors([att.k], stop, extra) if not late else need
        kv.append(sunk([n for n in order if n in first] + [n for n in order if n in need and n not in first], an))
    q_only = {att.node: [att.q, *(w for w in extra.get(att.node, ()) if base.get(w) == base.get(att.q, att.q))]
              for att in an.attentions}
    tail = tail_nodes(an)
    need = ancestors(q_roots(an, tail) + list(extra.get(output, ())), stop, extra, q_only)
    q = sunk([n for n in order if n in need], an)
    values = [v for att in an.attentions for v in (att.k, att.v)] + rowed_outputs(an)
    producers = {v: p for v in values if (p := producer(v, an)) is not None}
    # a donated output's producer overwrites the input's rows: nothing after it in phase Q may read them
    last = {v for v, p in producers.items() if p in q and all(is_view(n) for n in q[q.index(p) + 1:])}
    return Phases(const, kv, q, extra, producers, last, tail=[n for n in order if n in tail],
                  held_consts=_held_consts(an, order))


def _held_consts(an: Analysis, order: list[fx.Node]) -> set[fx.Node]:
    """The constant values something after the constant phase reads: a node with rows (or any node not computed
    once), a mask built from them, an output. The others (a second stream's intermediates computed once) die with
    the constant phase."""
    const = set(an.const)
    held = {m for n in order if n not in const for m in n.all_input_nodes if m in const}
    held |= {o for o in an.outputs if isinstance(o, fx.Node) and o in const}
    held |= {m for pm in an.pair_masks.values() for m in pm.leaves if m in const}
    return held


def q_roots(an: Analysis, tail: set[fx.Node] | list[fx.Node]) -> list[fx.Node]:
    """What phase Q computes per chunk: the outputs, except those a reduced attention's tail makes after the chunks,
    and each reduced attention (the chunk's part of it merged where the graph has it, its K and V let go there)."""
    tail = set(tail)
    return [o for o in an.outputs if isinstance(o, fx.Node) and o not in tail] + [r.node for r in an.reduced]


def in_place(nodes: list[fx.Node], an: Analysis, ph: Phases, keep: set) -> tuple[dict[fx.Node, Join],
                                                                                dict[fx.Node, fx.Node]]:
    """What a phase (``nodes`` as it runs, ``keep`` handed on) computes in place: joins built by their slots
    (``joins``), and ops written over an operand that dies with them (``reuse``); the executor and the memory model
    both take it from here, worked out once per capture."""
    key = (tuple(nodes), frozenset(keep))
    if key in ph.done:
        return ph.done[key]
    if an.static_rows:   # static rows are computed once per phase and their values kept for later chunks, and a
        # join along the rows hands a later chunk its dynamic input itself: only values of dynamic rows alone, made
        # per chunk, are written over, and no join is built in place
        avoid = {a.node for a in [*an.attentions, *an.reduced]} | set(ph.producers.values()) | {
            n for n in nodes if not dynamic_rows(an.rows.get(n))}
        found: tuple[dict, dict] = ({}, find_reuse(nodes, an, keep, avoid))
    else:
        joins = find_joins(nodes, an)
        # a join's slots are slices of its buffer; a join itself is a buffer of its own unless it writes into one
        avoid = {a.node for a in [*an.attentions, *an.reduced]} | set(ph.producers.values()) | {
            n for n, j in joins.items() if n is not j.node}
        found = (joins, find_reuse(nodes, an, keep, avoid))
    ph.done[key] = found
    return found


def rerun_attentions(an: Analysis, ph: Phases) -> list:
    """The global attentions a later attention's phase KV runs (its K/V read their output): streamed, each runs
    there over every chunk and again in phase Q, unless phase KV keeps its output whole for phase Q to read."""
    later = {n for p in ph.kv for n in p}
    return [a for a in an.attentions if a.node in later and a.q_rows is not None]


def keepable_outputs(an: Analysis, ph: Phases) -> list:
    """``rerun_attentions`` whose output phase KV can keep whole by chunks as phase Q would read them: not where a
    later chunk runs its dynamic rows alone (static rows once) or a chunk runs on a halo of rows beyond its own."""
    return [] if an.static_rows or an.halo != (0, 0) else rerun_attentions(an, ph)


def rowed_outputs(an: Analysis) -> list[fx.Node]:
    return [o for o in an.outputs if isinstance(o, fx.Node) and isinstance(an.rows.get(o), Rows)]


def last_uses(nodes: list[fx.Node], extra: dict | None = None) -> dict[int, list[fx.Node]]:
    """After which node each value is used for the last time; ``extra`` adds inputs a node reads off the graph's edges
    (a feature-sliced MLP's exit reads its region's inputs). A write nothing reads the result of, into a buffer the
    graph made for it (a rotary's halves copied into an ``empty_like``), goes after its own node: kept, its result
    (an alias) would hold that buffer to the phase's end."""
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for m in [*n.all_input_nodes, *(extra or {}).get(n, ())]:
            last[m] = i
        if not n.users and _fills_new_buffer(n):
            last[n] = i
    frees: dict[int, list[fx.Node]] = {}
    for m, i in last.items():
        frees.setdefault(i, []).append(m)
    return frees
