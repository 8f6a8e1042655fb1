"""A captured block under sequence parallelism: what the graph handler asks before it captures, plans and runs a block
whose attention spans ranks (``attention.ulysses`` has the exchanges, a library's probe says what the block runs under:
``integrations.diffusers.parallel``).

Every rank must run the same collectives in the same order, so every decision that changes them is the same on all
ranks: the budget a plan fits is the smallest any rank has (``agreed_budget``), the plan itself is compared across
ranks at its first call (``agreed_plan``: a mismatch raises on every rank, naming each rank's plan), no chunk is
retried alone after running out of memory, and the tiers that would change the exchanges (head groups, K/V stores)
are not offered."""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from ..attention.ulysses import SequenceParallel, UlyssesAttention, agree, agree_min, heads_problem, parallel_of


class PlanMismatch(RuntimeError):
    """Ranks planned a block differently: their collectives would not meet."""


def block_parallel(module: torch.nn.Module) -> SequenceParallel | None:
    return parallel_of(module)


def capture_scope(par: SequenceParallel | None) -> ContextManager[Any]:
    """Where the block is captured: without the library's collectives (its attention on the rank's own rows)."""
    if par is None or par.detach is None:
        return contextlib.nullcontext()
    return par.detach()


def consumer_problem(par: SequenceParallel, an: Any) -> str | None:
    """Why this captured block's attentions cannot stream under ``par`` (then the block runs stock), or None."""
    if par.problem:
        return par.problem
    if par.detach is None:
        return f"{par.label}: the library gives no way to capture the block without its collectives"
    for att in an.attentions:
        q, k = att.q.meta["val"], att.k.meta["val"]
        if q.dim() != 4 or k.dim() != 4 or att.q_rows is None or att.q_rows.dim != 2 or att.kv_rows.dim != 2:
            return f"{par.label}: an attention whose Q/K are not [batch, heads, rows, head_dim]"
        if att.causal:
            return f"{par.label}: causal attention (Ulysses streaming takes non-causal attention)"
        if not isinstance(q.shape[1], int) or not isinstance(k.shape[1], int):
            return f"{par.label}: head counts depend on the rows"
        why = heads_problem(par, q.shape[1], k.shape[1])
        if why:
            return f"{par.label}: {why}"
    return None


def consumer(inner: Any, par: SequenceParallel) -> UlyssesAttention:
    return UlyssesAttention(inner, par)


def agreed_budget(budget: int | None, par: SequenceParallel | None, device: torch.device) -> int | None:
    """The budget every rank plans with: the smallest of theirs (collective: every rank calls it at the same plan)."""
    if par is None or par.problem:
        return budget
    return agree_min(budget, par, device)


def fingerprint(plan: Any) -> str:
    return f"{plan.tier} rows={plan.rows} chunk={plan.chunk} ffn_slice={plan.ffn_slice} " \
           f"head_groups={plan.head_groups} kv={plan.kv}"


def agreed_plan(name: str, plan: Any, par: SequenceParallel | None, device: torch.device) -> None:
    """Raise ``PlanMismatch`` on every rank when any rank planned ``name`` differently (collective)."""
    if par is None or par.problem:
        return
    mine = fingerprint(plan)
    found = agree(mine, par, device)
    if len(set(found)) > 1:
        raise PlanMismatch(
            f"{name}: ranks planned this block differently under {par.label} (this rank, {par.rank}: {mine}; "
            f"plan hashes by rank {found}); their exchanges would not meet. Give every rank the same inputs, the same "
            "streamplan.apply arguments and a byte budget (or chunk_tokens) rather than one read off each card.")
