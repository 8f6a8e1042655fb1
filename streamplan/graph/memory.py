"""The memory model of a captured block, read off the graph: bytes per row of every value, which ops allocate and
which only view, and live ranges. Whole buffers (each global attention's K and V, the outputs) plus the worst moment
of one chunk's values is the predicted peak; the whole graph at every row is the stock estimate."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .analyze import Analysis, Rows, op_name, numel_besides
from .analyze import VIEW_OPS
from ..registries import ROW_CONTRACTION_WORKSPACE
from .phases import Phases, in_place, last_uses
from .opaque_layers import workspace_bytes as opaque_workspace
from .row_pieces import RowRun, find_runs, schedule
from .contraction_phases import contraction_phases


@dataclass
class GraphMemory:
    """Bytes as functions of the chunk: ``fixed`` (whole buffers) + the worst phase at ``chunk`` rows."""

    rows: int
    per_row: dict[fx.Node, int]        # bytes per dynamic row (0 for values without rows)
    static: dict[fx.Node, int]         # bytes of static rows and of values without rows
    allocates: dict[fx.Node, bool]
    phases: Phases
    kv_bytes: int                      # every global attention's K and V over all rows
    out_bytes: int                     # the row outputs over all rows (a donated output costs nothing)
    attention_nodes: set
    analysis: Analysis
    pieces: int = 1                    # row-local runs in this many pieces of the chunk (1: whole, no runs)
    kept_bytes: int = 0                # attention outputs phase KV keeps whole for phase Q (``rerun_attentions``)
    built_bytes: int = 0               # contractions' results (``row_contractions``): from phase KV through the call
    build_inputs: int = 0              # contractions' inputs whole (within ``kv_bytes``): let go once they are built
    build_work: int = 0                # the most a contraction op allocates in its call besides its result
    reduced_bytes: int = 0             # reduced attentions' merged outputs so far (fp32) and a chunk's partial ones
    const_bytes: int = 0               # values without rows held from the constant phase through the call

    @property
    def fixed(self) -> int:
        """What the call holds whatever the chunk: K/V, outputs, kept outputs, contractions' results, constants."""
        return self.kv_bytes + self.out_bytes + self.kept_bytes + self.built_bytes + self.const_bytes

    def value(self, node: fx.Node, rows: int) -> int:
        return self.per_row.get(node, 0) * rows + self.static.get(node, 0)

    def _phase(self, nodes: list[fx.Node], rows: int, ffn_slice: int = 0, regions=(), at_attention: int = 0,
               workspace: int = 0, keep: set | None = None) -> int:
        """Peak bytes of one chunk of ``rows`` through ``nodes``; with ``ffn_slice`` the MLP ``regions`` hold one slice
        of their hidden features at a time (the region's worst moment at that width, ``_region_peak``);
        ``at_attention``: bytes per row alive while a global attention runs, beside what is live there (a K/V store's
        merge); ``workspace``: bytes the attention call itself allocates then (the consumer's declaration); ``keep``
        (what the phase hands on) given: its row-local runs in pieces, as ``GraphRun`` runs them."""
        extra = at_attention * rows + workspace
        work = {n: extra for n in self.attention_nodes} if extra else {}
        for n in nodes:   # what an opaque module allocates inside its call (a dequantised weight, routed rows)
            if (w := opaque_workspace(n, rows)):
                work[n] = work.get(n, 0) + w
        reads: dict[fx.Node, list[fx.Node]] = {}
        if ffn_slice:
            inside = {n for r in regions for n in r.nodes}
            nodes = [n for n in nodes if n not in inside]
            for r in regions:   # the exit's own value (the accumulator) is live at the exit already
                work[r.exit] = int(self._region_peak(r, rows) * min(1.0, ffn_slice / r.ffn))
                reads[r.exit] = [r.x, *(m for n in r.nodes for m in n.all_input_nodes)]
        runs = self._runs(nodes, keep, reads) if keep is not None and self.pieces > 1 else []
        at_run = {r.marker: r for r in runs}
        joins, reuse = in_place(nodes, self.analysis, self.phases, keep) if self.pieces == 1 and keep is not None \
            else ({}, {})   # (the stock estimate, keep None: nothing in place)
        nodes = schedule(nodes, runs)
        frees = last_uses(nodes, extra={**reads, **{r.marker: r.inputs for r in runs}})
        owner: dict[fx.Node, fx.Node] = {}
        refs: dict[fx.Node, int] = {}
        live = peak = 0
        for i, n in enumerate(nodes):
            run = at_run.get(n)
            if run is not None:   # its outputs whole, beside one piece's values at their worst
                outs = sum(self.value(o, rows) for o in run.outputs if o not in run.reuse)
                peak = max(peak, live + outs + self._pieces_peak(run, -(-rows // self.pieces)))
                for o in run.outputs:   # an output in a dead input's storage keeps that storage alive
                    b = owner.get(run.reuse.get(o)) or o
                    owner[o], refs[b] = b, refs.get(b, 0) + 1
                live += outs
            elif n in reuse and reuse[n] in owner:   # over an operand that dies here: its storage, no new one
                owner[n] = owner[reuse[n]]
                refs[owner[n]] += 1
            elif (j := joins.get(n)) is not None and (n is not j.node or n in owner):
                if n is not j.node:   # a slot: its slice of the join's buffer, which the first slot makes
                    if j.node not in owner:
                        owner[j.node], refs[j.node] = j.node, 1
                        live += self.value(j.node, rows)
                    owner[n] = j.node
                    refs[j.node] += 1
            elif self.allocates.get(n, True):
                owner[n], refs[n] = n, 1
                live += self.value(n, rows)
            elif (base := next((owner[m] for m in n.all_input_nodes if m in owner), None)) is not None:
                owner[n] = base
                refs[base] += 1
            # else: a view of an input or a constant, which this chunk does not allocate
            peak = max(peak, live + work.get(n, 0))
            for m in frees.get(i, ()):
                live -= self._release(owner, refs, m, rows)
        return peak

    def _runs(self, nodes: list[fx.Node], keep: set, reads: dict) -> list[RowRun]:
        """``find_runs`` once per capture, phase and MLP slicing: the planner prices many chunks and piece counts."""
        key = ("runs", tuple(nodes), frozenset(keep), tuple(reads))
        if key not in self.phases.done:
            self.phases.done[key] = find_runs(nodes, self.analysis, keep, reads)
        return self.phases.done[key]

    def _release(self, owner: dict, refs: dict, m: fx.Node, rows: int) -> int:
        """Bytes freed when ``m`` dies: its storage's, once no other value (a view, an output written into it) holds
        that storage."""
        if m not in owner:
            return 0
        b = owner.pop(m)
        refs[b] -= 1
        return self.value(b, rows) if refs[b] == 0 else 0

    def _pieces_peak(self, run: RowRun, rows: int) -> int:
        """One piece of ``rows`` rows through a run: its values, each freed after its last use in the run (a view keeps
        its base), the piece's outputs until they are copied into their buffers; an expert layer's routed copies of
        the piece's rows beside them at its call."""
        return self._walk(run.nodes, run.dead, rows, joined=lambda n, own: opaque_workspace(n, rows))

    def _region_peak(self, r, rows: int) -> int:
        """The worst moment of one MLP region's values at full width (``run_region`` takes it a slice at a time):
        entries, then the elementwise nodes in graph order, each freed after its last use inside the region (what
        the exit reads stays); a fused entry's parts and their join are alive together where something joins them."""
        nodes = [*r.entries, *r.inner]
        return self._walk(nodes, last_uses(nodes), rows, joined=lambda n, own: own if r.joins_parts(n) else 0,
                          over=r.over)

    def _walk(self, nodes: list[fx.Node], dead: dict[int, list[fx.Node]], rows: int, joined=None,
              over: dict | None = None) -> int:
        """Peak bytes of ``nodes`` run in order at ``rows`` rows, ``dead[i]`` freed after node ``i`` (a view keeps its
        base's storage alive); ``joined(node, own bytes)``: bytes alive beside a node at its own moment only;
        ``over``: nodes written over an operand (its storage, no new one)."""
        owner: dict[fx.Node, fx.Node] = {}
        refs: dict[fx.Node, int] = {}
        live = peak = 0
        over = over or {}
        for i, n in enumerate(nodes):
            own = 0
            base = owner.get(over[n]) if n in over else None
            if base is None and not self.allocates.get(n, True):
                base = next((owner[m] for m in n.all_input_nodes if m in owner), None)
            if base is not None:
                owner[n] = base
                refs[base] += 1
            elif self.allocates.get(n, True):
                owner[n], refs[n] = n, 1
                own = self.value(n, rows)
                live += own
            peak = max(peak, live + (joined(n, own) if joined is not None else 0))
            for m in dead.get(i, ()):
                live -= self._release(owner, refs, m, rows)
        return peak

    def transient(self, chunk: int, ffn_slice: int = 0, regions=(), at_attention: int = 0, workspace: int = 0) -> int:
        """One chunk's worst moment over the phases beyond the whole buffers, as the executor runs them (row-local runs
        in pieces). Phase KV runs before the outputs' buffers exist: its moment is counted without them."""
        chunk = min(chunk, self.rows)
        an = self.analysis
        outputs = {o for o in an.outputs if isinstance(o, fx.Node)}
        kv = max([self._phase(p, chunk, keep={a.k, a.v}) for p, a in zip(self.phases.kv, an.attentions)]
                 + [self._phase(p, chunk, keep=set(c.inputs))
                    for p, c in zip(contraction_phases(an, self.phases), an.contractions)] + [self.build_work],
                 default=0)
        # phase Q runs after the contractions' inputs are let go (they are in ``kv_bytes`` for phase KV)
        # phase Q with the reduced attentions' merges beside it; their tail once after it, its own values alone; the
        # constant phase first, its held values within ``const_bytes``
        return max(kv - self.out_bytes, self._phase(self.phases.q, chunk, ffn_slice, regions, at_attention,
                                                    workspace, keep=outputs) - self.build_inputs
                   + self.reduced_bytes, self._phase(self.phases.tail, chunk),
                   self._phase(self.phases.const, chunk) - self.const_bytes)

    def predicted(self, chunk: int) -> int:
        return self.fixed + self.transient(chunk)

    def stock(self, nodes: list[fx.Node]) -> int:
        return self._phase(nodes, self.rows)


def graph_memory(an: Analysis, ph: Phases, rows: int, donated_outputs: set[int], pieces: int = 1,
                 kept: tuple = ()) -> GraphMemory:
    """``kept``: global attentions whose output phase KV keeps whole (``phases.rerun_attentions``)."""
    per_row: dict[fx.Node, int] = {}
    static: dict[fx.Node, int] = {}
    allocates: dict[fx.Node, bool] = {}
    nodes = {n for p in [*ph.kv, *contraction_phases(an, ph)] for n in p} | set(ph.q) | set(ph.const) | set(ph.tail)
    for n in nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        rws = an.rows.get(n)
        rws = rws if isinstance(rws, list) else [rws] * len(vals)
        pr = st = 0
        for v, r in zip(vals, rws):
            if not isinstance(v, torch.Tensor):
                continue
            elem = v.element_size()
            if isinstance(r, Rows):
                row = numel_besides(v, r.dim) * elem * r.outer // r.unit   # a grid's lines: per row, not per line
                pr, st = pr + row, st + row * (r.pre + r.post)
            else:
                st += numel_besides(v, None) * elem
        per_row[n], static[n] = pr, st
        name = op_name(n.target)
        same_dtype = all(isinstance(m.meta.get("val"), torch.Tensor) and isinstance(val, torch.Tensor)
                         and m.meta["val"].dtype == val.dtype for m in n.all_input_nodes[:1])
        allocates[n] = not (name in VIEW_OPS or n.target is operator.getitem or name.endswith("_")
                            or (name in ("to", "_to_copy", "type_as") and same_dtype))
    kv = 0
    for att in an.attentions:
        for t in (att.k, att.v):
            v = t.meta["val"]
            r = att.kv_rows
            kv += numel_besides(v, r.dim) * v.element_size() * (rows + r.pre + r.post)
    inputs = built = work = 0
    for c in an.contractions:   # a contraction's inputs built whole in phase KV (``row_contractions``), then its op
        for t in c.inputs:
            v, r = t.meta["val"], an.rows[t]
            inputs += numel_besides(v, r.dim) * v.element_size() * (rows + r.pre + r.post)
        built += _bytes(c.node.meta.get("val"))
        work = max(work, contraction_workspace(c.node))
    kv += inputs
    for n in an.built_whole:   # built once over every row, held through the call as K and V are
        v, r = n.meta["val"], an.rows[n]
        kv += numel_besides(v, r.dim) * v.element_size() * (rows + r.pre + r.post)
    out = 0
    for i, o in enumerate(an.outputs):
        r = an.rows.get(o) if isinstance(o, fx.Node) else None
        if isinstance(r, Rows) and i not in donated_outputs:
            v = o.meta["val"]
            out += numel_besides(v, r.dim) * v.element_size() * (rows + r.pre + r.post)
    held = 0
    for a in kept:
        v, r = a.node.meta["val"], a.q_rows
        held += numel_besides(v, r.dim) * v.element_size() * (rows + r.pre + r.post)
    merging = 0
    for r in an.reduced:   # fp32 output and log-sum-exp merged so far, and a chunk's log-sum-exp (its partial output
        o = r.node.meta["val"]   # is the node's own value in phase Q)
        merging += numel_besides(o, None) * 4 + numel_besides(o, o.dim() - 1) * 8
    consts = sum(static.get(n, 0) for n in _storages(ph.held_consts, allocates, set(an.const)))
    return GraphMemory(rows, per_row, static, allocates, ph, kv, out, {a.node for a in an.attentions}, an, pieces,
                       held, built, inputs, work, merging, consts)


def _storages(values, allocates: dict, const: set) -> set[fx.Node]:
    """The constant-phase nodes whose storage ``values`` hold: a view's (a permute of a projection, a cast to the
    same dtype) is its base's; a view of an input or a parameter holds nothing new."""
    found = set()
    for n in values:
        while not allocates.get(n, True) and n.all_input_nodes:
            n = n.all_input_nodes[0]
        if n in const and allocates.get(n, True):
            found.add(n)
    return found


def _bytes(val) -> int:
    return sum(numel_besides(v, None) * v.element_size() for v in (val if isinstance(val, (tuple, list)) else [val])
               if isinstance(v, torch.Tensor))


def contraction_workspace(node: fx.Node) -> int:
    """What a custom contraction op allocates in its call besides its result, as its integration declares it
    (``registries.register_row_contraction_op``'s ``workspace``, given the op's result and arguments as the graph
    holds them); 0 for any other op."""
    declare = ROW_CONTRACTION_WORKSPACE.get((getattr(node.target, "namespace", None), op_name(node.target)))
    if declare is None:
        return 0
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    return int(declare(node.meta.get("val"), *args))
