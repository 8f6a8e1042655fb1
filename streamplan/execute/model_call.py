"""Handler for a hand-written model forward (Wan, MiniMax-H3, transformers decoders): its blocks plan themselves;
the model's own row loops take the smallest chunk its blocks planned."""
from __future__ import annotations

from typing import Any

import torch

from .context import CallContext
from .call_state import needs_grad, shapes
from ..specs import ModelSpec
from ..plan.planner import DEFAULT_CHUNK_TOKENS, Plan, Tier


def run_model(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    entry = ctx.entry
    spec: ModelSpec = entry.spec
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    why = spec.can_stream(args, kwargs)
    if why is None and tensors and needs_grad(entry.module, tensors[0]):
        why = "autograd is recording"
    if why:
        ctx.note(f"model forward ran stock: {why}")
        return entry.stock(*args, **kwargs)
    first = not entry.plans
    before = {id(p) for e in ctx.installed() for p in e.plans.values()}
    o = ctx.options
    fixed = o.chunk_tokens or (DEFAULT_CHUNK_TOKENS if o.budget is None else None)
    plan = ctx.plan((shapes(args, kwargs), tensors[0].dtype if tensors else None, "model"),
                           lambda _: Plan(Tier.L1, 0, fixed or 0, 0, 0, 0, note="model forward: block inputs "
                                          "donated, its own row loops (input projections, output head) in "
                                          + (f"{fixed}-row chunks" if fixed else "its blocks' smallest chunk")),
                           args, kwargs, tensors[0].device)
    if plan.tier == Tier.L0:   # every block fitted stock at the first call: the stock forward, as stock
        return entry.stock(*args, **kwargs)

    def chunk() -> int:
        """The model's own row loops: the given chunk, or under a budget its blocks' smallest planned chunk."""
        if fixed:
            return fixed
        planned = [p.chunk for e in ctx.installed() if e is not entry for p in e.plans.values()
                   if p.tier != Tier.L0 and p.chunk > 0]   # a model forward's own plan (an outer one) has no chunk
        return min(planned, default=DEFAULT_CHUNK_TOKENS)

    out = spec.run(args, kwargs, chunk)
    if first:   # the model's figures are its largest block's, planned during this first call
        inner = [p for e in ctx.installed() for p in e.plans.values() if id(p) not in before and p is not plan]
        if inner:
            worst = max(inner, key=lambda p: p.predicted_total)
            plan.rows, plan.predicted_peak = worst.rows, worst.predicted_total - plan.live_bytes
            plan.stock_peak = max(p.live_bytes + p.stock_peak for p in inner) - plan.live_bytes
            plan.predicted_peak, plan.stock_peak = max(0, plan.predicted_peak), max(0, plan.stock_peak)
            if all(p.tier == Tier.L0 for p in inner):
                plan.tier, plan.note = Tier.L0, "model forward: every block fits stock here: the stock forward"
    return out
