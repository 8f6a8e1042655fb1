"""Attentions whose queries are a small fixed set and whose keys are the rows (an audio stream's queries against
the video rows): where nothing computed over the rows reads their output, phase Q reduces them over its chunks
instead of phase KV building their K and V whole. Each chunk attends the fixed queries to its own rows' K/V and
merges the partial output by its log-sum-exp (``attention.lse_merge``); after the last chunk the values that read
the output (the "tail": the audio side's gate, norm and MLP) run once. The attention then costs one pass over the
rows, no K/V buffer over every row, and no earlier attention run again in a phase KV of its own.

Found once per capture: the attention leaves ``Analysis.attentions`` for ``Analysis.reduced``, and ``phases_of``
takes its K/V into phase Q and its tail out of it."""
from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from .analyze import Analysis, GlobalAttention, Rows, op_name


@dataclass(eq=False)
class ReducedAttention:
    """A global attention with fixed queries, run as a reduction over phase Q's chunks."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float | None
    kv_rows: Rows


def reduce_static_queries(an: Analysis, graph: fx.Graph) -> None:
    """Move each global attention that can run as a reduction over the chunks from ``an.attentions`` to
    ``an.reduced``; the others, and blocks whose layout the reduction does not follow, are left as they are."""
    if an.static_rows or an.halo != (0, 0) or an.contractions or an.fixed_cuts or an.pair_masks:
        return   # (a phase's static rows, widened chunks, rows built ahead or cut: none of them met yet)
    candidates = [a for a in an.attentions if _eligible(a, an)]
    while candidates:
        tail = _tail({a.node for a in candidates})
        bad = [a for a in candidates if not _closed(_tail({a.node}), tail, {c.node for c in candidates}, an)]
        if not bad:
            break
        candidates = [a for a in candidates if a not in bad]
    if not candidates:
        return
    taken = {a.node for a in candidates}
    an.attentions = [a for a in an.attentions if a.node not in taken]
    an.reduced = [ReducedAttention(a.node, a.q, a.k, a.v, a.scale, a.kv_rows) for a in candidates]


def tail_nodes(an: Analysis) -> set[fx.Node]:
    """What reads the reduced attentions' outputs, at any remove (run once, after phase Q's last chunk)."""
    return _tail({r.node for r in an.reduced}) if an.reduced else set()


def _eligible(a: GlobalAttention, an: Analysis) -> bool:
    """Fixed queries computed once (no rows among their inputs), keys over the rows alone, nothing but a softmax over
    them: what a merge of partial outputs by their log-sum-exps computes exactly."""
    r = a.kv_rows
    return (a.q_rows is None and not a.causal and a.mask is None and not a.softcap and a.sinks is None
            and (r.pre, r.post) == (0, 0) and r.unit == 1 and (a.q in an.const or _unrowed_input(a.q, an))
            and a.q.meta["val"].shape[-1] == a.v.meta["val"].shape[-1] and a.q.meta["val"].dim() == 4)


def _unrowed_input(n: fx.Node, an: Analysis) -> bool:
    return n.op == "placeholder" and not isinstance(an.rows.get(n), Rows)


def _tail(roots: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [u for r in roots for u in r.users]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        todo.extend(n.users)
    return seen


def _closed(own: set[fx.Node], tail: set[fx.Node], reduced: set[fx.Node], an: Analysis) -> bool:
    """Whether a tail can run once after the chunks: no rows in it, nothing in it read by another global attention,
    no writes into storage it does not make, and every input either its own, a reduced output, or computed once."""
    other = {m for a in an.attentions if a.node not in reduced for m in (a.node, a.q, a.k, a.v, a.mask, a.sinks)}
    for n in own:
        rows = an.rows.get(n)
        if any(isinstance(r, Rows) for r in (rows if isinstance(rows, list) else [rows])) or n in other:
            return False
        if op_name(n.target).endswith("_") and n.target is not operator.getitem:
            return False
        for m in n.all_input_nodes:
            if m not in tail and m not in reduced and m not in an.const and not _unrowed_input(m, an):
                return False
    return True
