"""A phase's schedule: the order its nodes run in on a chunk, with every rewrite of the graph decided once per
capture and phase instead of per node per chunk: a feature-sliced MLP run at its exit (its inner nodes skipped), a run
of row-local nodes on row pieces of the chunk, a chain of element-wise ops as one compiled kernel, a join built in
place by its parts, an op written over a dying operand; and after which step each value is freed. The executor
(``execute.graph_run``) reads one ``Step`` per node and does what its kind says."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from .analyze import Analysis
from .fused_chains import MIN_BYTES, FusedChain, find_chains
from .joins_in_place import Join
from .phases import Phases, in_place, last_uses
from .pruned_projections import PrunedProjection, find_prunings
from .row_pieces import find_runs, schedule
from .sliced_mlp import MLPRegion

# what a step does, decided once; the first of these that applies to a node is its kind
PIECES = "row pieces"        # ``item``: a ``row_pieces.RowRun`` run at its marker node
CHAIN = "fused chain"        # ``item``: a ``fused_chains.FusedChain`` run at its marker node
REGION = "sliced mlp"        # ``item``: a ``sliced_mlp.MLPRegion`` run at its exit
ATTENTION = "attention"      # ``item``: the ``analyze.GlobalAttention`` this node is
REDUCE = "reduced attention"  # ``item``: the ``reduced_attentions.ReducedAttention`` this node is (merged per chunk)
PRUNED = "pruned projection"  # ``item``: a ``pruned_projections.PrunedProjection`` run at its linear
OP = "op"                    # the node's own op (with ``join`` / ``over`` where it may run in place)


@dataclass(eq=False)
class Step:
    node: fx.Node
    kind: str
    item: Any = None
    join: Join | None = None          # an OP that is a join its parts build in place (``joins_in_place``)
    over: fx.Node | None = None       # an OP that writes its result over this dying operand (``in_place``)
    frees: tuple[fx.Node, ...] = ()   # values whose last use is this step


@dataclass(eq=False)
class Schedule:
    steps: list[Step]
    chains: list[FusedChain] = field(default_factory=list)   # the compiled chains it runs (the report's)
    prunings: list[PrunedProjection] = field(default_factory=list)   # projections run for the columns read


def phase_schedule(nodes: list[fx.Node], keep: set[fx.Node], an: Analysis, ph: Phases, *,
                   regions: list[MLPRegion], pieces: int, fuse: bool, fuse_rows: int,
                   layout: frozenset = frozenset()) -> Schedule:
    """The schedule of ``nodes`` (a phase, handing ``keep`` on). ``regions``: MLPs sliced by hidden features;
    ``pieces`` > 1: row-local runs on that many row pieces (and nothing in place); ``fuse``: element-wise chains
    compiled, those whose outputs at ``fuse_rows`` rows (0: any) are worth a compiled call; ``layout``: the cuts and
    joins along the rows that pass dynamic rows through (static rows computed once)."""
    inside = {n for r in regions for n in r.nodes}
    run = [n for n in nodes if n not in inside] if inside else nodes
    extra = {r.exit: [r.x, *(m for n in r.nodes for m in n.all_input_nodes)] for r in regions}
    prunings = _prunings(run, keep, an, ph)
    pruned = {n for p in prunings for n in p.nodes}
    rest = [n for n in run if n not in pruned] if pruned else run   # the rewrites below: none of a pruned one's
    runs = find_runs(rest, an, keep, extra) if pieces > 1 else []
    joins, reuse = in_place(rest, an, ph, keep) if pieces == 1 else ({}, {})
    chains = [c for c in (_chains(rest, keep, extra, an, ph, layout) if fuse else [])
              if not fuse_rows or c.row_bytes * fuse_rows >= MIN_BYTES]
    if chains or pruned:   # a chain's values are its kernel's, a pruned one's its slices: no eager rule writes them
        inside = {n for c in chains for n in c.nodes} | pruned
        joins = {n: j for n, j in joins.items() if not inside & {j.node, *j.inputs, *j.slots, *j.feeds}}
        reuse = {n: m for n, m in reuse.items() if n not in inside and m not in inside}
    run = schedule(run, [*runs, *chains, *prunings])
    frees = last_uses(run, extra={**extra, **{r.marker: r.inputs for r in [*runs, *chains, *prunings]}})
    at_run, at_chain = {r.marker: r for r in runs}, {c.marker: c for c in chains}
    at_region, at_attention = {r.exit: r for r in regions}, {att.node: att for att in an.attentions}
    at_pruned = {p.marker: p for p in prunings}
    at_reduced = {r.node: r for r in an.reduced}
    steps = []
    for i, node in enumerate(run):
        if node in at_pruned:
            step = Step(node, PRUNED, at_pruned[node])
        elif node in at_run:
            step = Step(node, PIECES, at_run[node])
        elif node in at_chain:
            step = Step(node, CHAIN, at_chain[node])
        elif node in at_region:
            step = Step(node, REGION, at_region[node])
        elif node in at_attention:
            step = Step(node, ATTENTION, at_attention[node])
        elif node in at_reduced:
            step = Step(node, REDUCE, at_reduced[node])
        else:
            step = Step(node, OP, join=joins.get(node), over=reuse.get(node))
        step.frees = tuple(frees.get(i, ()))
        steps.append(step)
    return Schedule(steps, chains, prunings)


def _prunings(run: list[fx.Node], keep: set, an: Analysis, ph: Phases) -> list[PrunedProjection]:
    """``find_prunings`` once per capture and phase (their first-chunk checks kept with them)."""
    key = ("prunings", tuple(run), frozenset(keep))
    if key not in ph.done:
        ph.done[key] = find_prunings(run, keep, an)
    return ph.done[key]


def _chains(run: list[fx.Node], keep: set, extra: dict, an: Analysis, ph: Phases, layout: frozenset
            ) -> list[FusedChain]:
    """``find_chains`` once per capture (a call's run is new each time: building a chain's graph is not free)."""
    key = ("chains", tuple(run), frozenset(keep))
    if key not in ph.done:
        ph.done[key] = find_chains(run, an, keep, extra, layout)
    return ph.done[key]
