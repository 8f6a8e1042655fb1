"""Autocast regions that turn autocast off (``torch.amp.autocast(device, enabled=False)`` around a rotary),
taken into the graph as plain ops.

Export keeps such a region as a higher-order op over a subgraph, which the analysis cannot see into. Where autocast is
off for that device when the block runs, turning it off changes nothing, so the region's ops are the graph's own; a
call made under an enabled autocast for that device keeps its stock path (``graph_call`` checks). A region that turns
autocast on (casting inside it) is left as it is, and the analysis names it.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

_WRAP = getattr(getattr(torch.ops, "higher_order", None), "wrap_with_autocast", None)


def inline_autocast_off(graph: fx.Graph, root: torch.nn.Module) -> frozenset[str]:
    """Inline every region of ``graph`` that turns autocast off; the device types whose autocast must be off when
    the graph runs."""
    devices: set[str] = set()
    for node in list(graph.nodes):
        if _WRAP is None or node.target is not _WRAP:
            continue
        device, _dtype, enabled, _cache, sub_node, *operands = node.args
        if enabled or not isinstance(sub_node, fx.Node) or sub_node.op != "get_attr":
            continue
        sub = getattr(root, sub_node.target)
        outputs = _inline(graph, node, sub.graph, operands)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"an autocast region's output read by {user.target}, not by index")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
        devices.add(str(device))
    return frozenset(devices)


def _inline(graph: fx.Graph, at: fx.Node, sub: fx.Graph, operands: list) -> list:
    """The subgraph's nodes copied before ``at``, its placeholders bound to ``operands``; its outputs."""
    env: dict[fx.Node, object] = {}
    places = [n for n in sub.nodes if n.op == "placeholder"]
    env.update(zip(places, operands))
    out: list = []
    with graph.inserting_before(at):
        for n in sub.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = list(fx.node.map_arg(n.args[0], lambda m: env[m]))
                continue
            if n.op != "call_function":
                raise RuntimeError(f"an autocast region holding a {n.op} node")
            copy = graph.node_copy(n, lambda m: env[m])
            copy.meta = dict(n.meta)
            env[n] = copy
    return out


def autocast_problem(devices: frozenset[str]) -> str | None:
    """Why a graph with regions that turn autocast off cannot run as captured now, or None."""
    on = sorted(d for d in devices if torch.is_autocast_enabled(d))
    if on:
        return (f"an autocast region turning autocast off for {on[0]} runs under an enabled autocast for {on[0]}: "
                f"its ops were taken in as plain ones, so the block runs stock")
    return None
