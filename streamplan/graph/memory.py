"""The memory model of a captured block, read off the graph: bytes per row of every value, which ops allocate and
which only view, and live ranges. Whole buffers (each global attention's K and V, the outputs) plus the worst moment
of one chunk's values is the predicted peak; the whole graph at every row is the stock estimate."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from .analyze import DTYPE_CONVERSIONS, Analysis, Rows, op_name, numel_besides
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
    compiled: dict = field(default_factory=dict, repr=False, compare=False)   # each phase's walk (``PhaseLines``)

    @property
    def fixed(self) -> int:
        """What the call holds whatever the chunk: K/V, outputs, kept outputs, contractions' results, constants."""
        return self.kv_bytes + self.out_bytes + self.kept_bytes + self.built_bytes + self.const_bytes

    def _phase(self, nodes: list[fx.Node], rows: int, ffn_slice: int = 0, regions=(), at_attention: int = 0,
               workspace: int = 0, keep: set | None = None) -> int:
        """Peak bytes of one chunk of ``rows`` through ``nodes``; with ``ffn_slice`` the MLP ``regions`` hold one slice
        of their hidden features at a time (the region's worst moment at that width, ``_region_peak``);
        ``at_attention``: bytes per row alive while a global attention runs, beside what is live there (a K/V store's
        merge); ``workspace``: bytes the attention call itself allocates then (the consumer's declaration); ``keep``
        (what the phase hands on) given: its row-local runs in pieces, as ``GraphRun`` runs them. The walk over the
        nodes does not depend on the row count, so it is made once per phase and setting (``PhaseLines``) and each
        chunk the planner tries is a few multiply-adds."""
        key = (id(nodes), ffn_slice > 0, tuple(map(id, regions)) if ffn_slice else (),
               None if keep is None else frozenset(keep))
        lines = self.compiled.get(key)
        if lines is None:
            lines = self.compiled[key] = self._lines(nodes, ffn_slice > 0, regions, keep)
        return lines.peak(rows, ffn_slice, at_attention * rows + workspace)

    def _lines(self, nodes: list[fx.Node], sliced: bool, regions, keep: set | None) -> PhaseLines:
        """The phase's walk with every byte count as (per row, fixed): the live bytes at each node's moment (with what
        an opaque module allocates inside its call, linear too), and what is alive beside it there that is not linear
        in the rows (an MLP region's slice, a row-local run's piece), as functions of the rows."""
        calls: list[tuple[int, int, Callable[[int, int], int]]] = []
        reads: dict[fx.Node, list[fx.Node]] = {}
        region_exit: dict[fx.Node, object] = {}
        held = nodes   # the cache key is this list's id: the compiled lines keep the list alive
        if sliced:
            inside = {n for r in regions for n in r.nodes}
            nodes = [n for n in nodes if n not in inside]
            for r in regions:   # the exit's own value (the accumulator) is live at the exit already
                region_exit[r.exit] = r
                reads[r.exit] = [r.x, *(m for n in r.nodes for m in n.all_input_nodes)]
        runs = self._runs(nodes, keep, reads) if keep is not None and self.pieces > 1 else []
        at_run = {r.marker: r for r in runs}
        joins, reuse = in_place(nodes, self.analysis, self.phases, keep) if self.pieces == 1 and keep is not None \
            else ({}, {})   # (the stock estimate, keep None: nothing in place)
        nodes = schedule(nodes, runs)
        frees = last_uses(nodes, extra={**reads, **{r.marker: r.inputs for r in runs}})
        owner: dict[fx.Node, fx.Node] = {}
        refs: dict[fx.Node, int] = {}
        moments: list[tuple[int, int]] = []     # (per row, fixed) alive at each moment, nothing non-linear beside it
        attention: list[tuple[int, int]] = []   # the same at a global attention (a store's merge beside it)
        live_r = live_f = 0
        for i, n in enumerate(nodes):
            run = at_run.get(n)
            if run is not None:   # its outputs whole, beside one piece's values at their worst
                outs = [o for o in run.outputs if o not in run.reuse]
                out_r, out_f = sum(self.per_row.get(o, 0) for o in outs), sum(self.static.get(o, 0) for o in outs)
                calls.append((live_r + out_r, live_f + out_f,
                              lambda rows, _sl, run=run: self._pieces_peak(run, -(-rows // self.pieces))))
                for o in run.outputs:   # an output in a dead input's storage keeps that storage alive
                    b = owner.get(run.reuse.get(o)) or o
                    owner[o], refs[b] = b, refs.get(b, 0) + 1
                live_r, live_f = live_r + out_r, live_f + out_f
            elif n in reuse and reuse[n] in owner:   # over an operand that dies here: its storage, no new one
                owner[n] = owner[reuse[n]]
                refs[owner[n]] += 1
            elif (j := joins.get(n)) is not None and (n is not j.node or n in owner):
                if n is not j.node:   # a slot: its slice of the join's buffer, which the first slot makes
                    if j.node not in owner:
                        owner[j.node], refs[j.node] = j.node, 1
                        live_r, live_f = live_r + self.per_row.get(j.node, 0), live_f + self.static.get(j.node, 0)
                    owner[n] = j.node
                    refs[j.node] += 1
            elif self.allocates.get(n, True):
                owner[n], refs[n] = n, 1
                live_r, live_f = live_r + self.per_row.get(n, 0), live_f + self.static.get(n, 0)
            elif (base := next((owner[m] for m in n.all_input_nodes if m in owner), None)) is not None:
                owner[n] = base
                refs[base] += 1
            # else: a view of an input or a constant, which this chunk does not allocate
            region = region_exit.get(n)
            if region is not None:   # (its slice replaces whatever else the exit would hold beside it)
                calls.append((live_r, live_f, lambda rows, sl, r=region: int(self._region_peak(r, rows)
                                                                           * min(1.0, sl / r.ffn))))
            else:   # what an op allocates inside its call: a fixed part and a part per row
                in_r, in_f = self._inside(n)
                at_r, at_f = live_r + in_r, live_f + in_f
                (attention if n in self.attention_nodes else moments).append((at_r, at_f))
            for m in frees.get(i, ()):
                b = self._freed(owner, refs, m)
                if b is not None:
                    live_r, live_f = live_r - self.per_row.get(b, 0), live_f - self.static.get(b, 0)
        return PhaseLines(_envelope(moments), _envelope(attention), tuple(calls), held, tuple(regions))

    def _inside(self, n: fx.Node) -> tuple[int, int]:
        """What ``n``'s call allocates inside it besides its result, (per row, fixed): an opaque module's declared
        workspace, or a CPU RMSNorm's own float32 copies (``cpu_norm_copies``)."""
        copies = cpu_norm_copies(n)
        return (opaque_workspace(n, 1) - opaque_workspace(n, 0) + int(copies * self.per_row.get(n, 0)),
                opaque_workspace(n, 0) + int(copies * self.static.get(n, 0)))

    def _runs(self, nodes: list[fx.Node], keep: set, reads: dict) -> list[RowRun]:
        """``find_runs`` once per capture, phase and MLP slicing: the planner prices many chunks and piece counts."""
        key = ("runs", tuple(nodes), frozenset(keep), tuple(reads))
        if key not in self.phases.done:
            self.phases.done[key] = find_runs(nodes, self.analysis, keep, reads)
        return self.phases.done[key]

    @staticmethod
    def _freed(owner: dict, refs: dict, m: fx.Node) -> fx.Node | None:
        """The storage freed when ``m`` dies (None: none): its own or its base's, once no other value (a view, an
        output written into it) holds that storage."""
        if m not in owner:
            return None
        b = owner.pop(m)
        refs[b] -= 1
        return b if refs[b] == 0 else None

    def _pieces_peak(self, run: RowRun, rows: int) -> int:
        """One piece of ``rows`` rows through a run: its values, each freed after its last use in the run (a view keeps
        its base), the piece's outputs until they are copied into their buffers; an expert layer's routed copies of
        the piece's rows beside them at its call."""
        key = ("pieces", id(run))
        if key not in self.compiled:
            self.compiled[key] = (run, self._walk(run.nodes, run.dead, beside=lambda n, own: self._inside(n)))
        return _at(self.compiled[key][1], rows)

    def _region_peak(self, r, rows: int) -> int:
        """The worst moment of one MLP region's values at full width (``run_region`` takes it a slice at a time):
        entries, then the elementwise nodes in graph order, each freed after its last use inside the region (what
        the exit reads stays); a fused entry's parts and their join are alive together where something joins them."""
        key = ("region", id(r))
        if key not in self.compiled:
            nodes = [*r.entries, *r.inner]
            self.compiled[key] = (r, self._walk(nodes, last_uses(nodes), over=r.over,
                                                beside=lambda n, own: own if r.joins_parts(n) else (0, 0)))
        return _at(self.compiled[key][1], rows)

    def _walk(self, nodes: list[fx.Node], dead: dict[int, list[fx.Node]], beside=None,
              over: dict | None = None) -> tuple[tuple[int, int], ...]:
        """The peak bytes of ``nodes`` run in order, as lines in the rows (``_envelope``), ``dead[i]`` freed after node
        ``i`` (a view keeps its base's storage alive); ``beside(node, own (per row, fixed))``: bytes alive beside a
        node at its own moment only, (per row, fixed); ``over``: nodes written over an operand (its storage, no new
        one)."""
        owner: dict[fx.Node, fx.Node] = {}
        refs: dict[fx.Node, int] = {}
        live_r = live_f = 0
        moments: list[tuple[int, int]] = []
        over = over or {}
        for i, n in enumerate(nodes):
            own = (0, 0)
            base = owner.get(over[n]) if n in over else None
            if base is None and not self.allocates.get(n, True):
                base = next((owner[m] for m in n.all_input_nodes if m in owner), None)
            if base is not None:
                owner[n] = base
                refs[base] += 1
            elif self.allocates.get(n, True):
                owner[n], refs[n] = n, 1
                own = (self.per_row.get(n, 0), self.static.get(n, 0))
                live_r, live_f = live_r + own[0], live_f + own[1]
            add = beside(n, own) if beside is not None else (0, 0)
            moments.append((live_r + add[0], live_f + add[1]))
            for m in dead.get(i, ()):
                b = self._freed(owner, refs, m)
                if b is not None:
                    live_r, live_f = live_r - self.per_row.get(b, 0), live_f - self.static.get(b, 0)
        return _envelope(moments)

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


@dataclass(frozen=True, eq=False)
class PhaseLines:
    """One phase's walk at any row count: the moments whose bytes are linear in the rows as (per row, fixed) lines
    with the dominated ones dropped (plain, and at a global attention, where a store's merge adds its own), and the
    moments beside something that is not (an MLP region's slice, a run's piece) with it as ``(rows, ffn_slice) ->
    bytes``. ``held``: the phase's node list and regions, whose ids key the cache."""

    lines: tuple[tuple[int, int], ...]
    attention: tuple[tuple[int, int], ...]
    calls: tuple[tuple[int, int, Callable[[int, int], int]], ...]
    held: list
    regions: tuple

    def peak(self, rows: int, ffn_slice: int, at_attention: int) -> int:
        peak = _at(self.lines, rows)
        if self.attention:
            peak = max(peak, _at(self.attention, rows) + at_attention)
        for a, b, extra in self.calls:
            peak = max(peak, a * rows + b + extra(rows, ffn_slice))
        return peak


def _at(lines: tuple[tuple[int, int], ...], rows: int) -> int:
    """The largest of ``lines`` at ``rows`` rows (0 where there are none)."""
    return max((a * rows + b for a, b in lines), default=0)


def _envelope(lines: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The lines ``a * rows + b`` that are the largest at some row count >= 1: any line another beats on both parts is
    dropped (exact for every row count, not an approximation)."""
    kept: list[tuple[int, int]] = []
    for a, b in sorted(set(lines), key=lambda x: (-x[0], -x[1])):   # steepest first: a later line survives only higher
        if not kept or b > kept[-1][1]:   # (each kept line is higher at 0 rows than every steeper one)
            kept.append((a, b))
    return tuple(kept)


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
                            or (name in DTYPE_CONVERSIONS and same_dtype))
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


def cpu_norm_copies(n: fx.Node) -> float:
    """How many of its results' bytes an RMSNorm on the CPU allocates inside its call. The CPU kernel computes in
    float32: a half-precision input is copied to float32 and normalised there, its result converted back (1.5 float32
    copies beyond the result), and a weight multiplies in float32 once more (one copy more). ``tests/test_made_late.py``
    holds this against the meter for each case. CUDA's is one fused kernel, and meta tensors plan for it."""
    if n.op != "call_function" or op_name(n.target) not in ("rms_norm", "_fused_rms_norm"):
        return 0.0
    val = n.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or not val.is_floating_point():
        return 0.0
    weighted = len(n.args) > 2 and n.args[2] is not None or n.kwargs.get("weight") is not None
    wide = 4 / val.element_size()   # one float32 copy, in results' worth
    return wide * ((1.5 if val.element_size() < 4 else 0.0) + (1.0 if weighted else 0.0))


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
