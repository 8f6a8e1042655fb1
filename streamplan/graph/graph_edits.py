"""Small edits every graph rewrite makes: where a node stands in its graph, and erasing what a rewrite left unused."""
from __future__ import annotations

from torch import fx


def graph_order(graph: fx.Graph):
    """A sort key: a node's place in ``graph`` as it stands now."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase those of ``nodes`` nothing uses, the latest first (a node freed by a later one's erasure goes too)."""
    for n in sorted(nodes, key=graph_order(graph), reverse=True):
        if not n.users:
            graph.erase_node(n)
