"""What phase KV runs for the contractions over every row (``row_contractions``), and what it cannot: its chunks are
not widened by a halo, so nothing phase KV computes (K and V, a contraction's inputs) may read one, nor an attention's
output or another contraction. Worked out on the phases, after the analysis."""
from __future__ import annotations

from typing import Any

from torch import fx

from .phases import ancestors, writes_before


def phase_kv_problem(an: Any, graph: fx.Graph) -> str | None:
    """Why phase KV cannot compute what it must (K/V and contractions' inputs) from unwidened chunks: a halo op, an
    attention's output or another contraction upstream of them; or None."""
    if not an.contractions and not an.halo_nodes:
        return None
    order = [n for n in graph.nodes if n.op == "call_function"]
    extra = writes_before(order)
    attention_nodes = {a.node for a in an.attentions}
    contraction_nodes = {c.node for c in an.contractions}
    for c in an.contractions:
        up = ancestors(list(c.inputs), set(), extra)
        if up & an.halo_nodes:
            return ("a contraction over the rows of values a convolution's halo feeds (phase KV's chunks are not "
                    "widened)")
        if up & (attention_nodes | contraction_nodes):
            return "a contraction over the rows of values an attention or another contraction over the rows makes"
    for att in an.attentions:
        up = ancestors([att.k, att.v], set(), extra)
        if up & an.halo_nodes:
            return ("a convolution along the rows in a block with a global attention, feeding its K or V: phase KV's "
                    "chunks are not widened by its halo")
    if an.halo_nodes and an.attentions and len(an.attentions) > 1:
        return "a convolution along the rows in a block with several global attentions"
    return None


def contraction_phases(an: Any, ph: Any) -> list[list[fx.Node]]:
    """Per contraction, the nodes phase KV runs on each chunk to build its inputs (in graph order); worked out once
    per capture."""
    key = ("row contractions",)
    if key not in ph.done:
        lists = []
        for c in an.contractions:
            graph = c.node.graph
            stop = set(an.const) | an.read_as_inputs | {n for n in graph.nodes if n.op == "placeholder"}
            need = ancestors(list(c.inputs), stop, ph.writes)
            lists.append([n for n in graph.nodes if n in need and n.op == "call_function" and n not in an.ignored])
        ph.done[key] = lists
    return ph.done[key]
