"""Handler for a hand-written model forward (Wan, MiniMax-H3, transformers decoders): under a budget the whole forward
is planned before it runs (``forward_plan``: rehearsed on fake tensors, its blocks planning as they will); the model's
own row loops take the smallest chunk its blocks planned."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable

import torch

from . import hook_chains as hooks, host_rows
from .context import CallContext
from .call_state import bypass, needs_grad, planned_ahead, rehearsing, shapes
from .forward_plan import forward_problem, plan_forward
from .rehearsal import RehearsalFailed
from ..specs import ModelSpec, RowLoops
from ..plan.budget import fmt_bytes
from ..plan.planner import DEFAULT_CHUNK_TOKENS, HostMemoryError, Plan, Tier

log = logging.getLogger("streamplan")


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
    o = ctx.options
    fixed = o.chunk_tokens or (DEFAULT_CHUNK_TOKENS if o.budget is None else None)

    def chunk() -> int:
        """The model's own row loops: the given chunk, or under a budget its blocks' smallest planned chunk, at most
        the default chunk (a loose budget lets a block take tens of thousands of rows a chunk; a final norm or head
        in fp32 over that many rows beside the whole hidden state would be what overshoots)."""
        if fixed:
            return fixed
        return smallest_planned_chunk(p for e in ctx.installed() if e is not entry for p in e.plans.values())

    def run(a: tuple, k: dict, host: bool = False) -> Any:
        return spec.run(a, k, RowLoops(chunk, host))

    if rehearsing():
        return run(args, kwargs)
    sig = (shapes(args, kwargs), tensors[0].dtype if tensors else None, "model")
    first = sig not in entry.plans
    ahead = first and o.budget is not None and o.chunk_tokens is None and bool(tensors)
    problem = forward_problem(entry.module, args, kwargs) if ahead else None
    before = {id(p) for e in ctx.installed() for p in e.plans.values()}
    # planned ahead, the forward's budget is what it adds above what was allocated when it began: its inputs aside
    counted = ((), {}) if ahead and problem is None else (args, kwargs)
    host = spec.host_rows and o.hidden == "host"   # forced; under a budget planned ahead, the planner's choice
    plan = ctx.plan(sig, lambda _: Plan(Tier.L6 if host else Tier.L1, 0, fixed or 0, 0, 0, 0, note="model forward: "
                                        "block inputs donated, its own row loops (input projections, output head) in "
                                        + (f"{fixed}-row chunks" if fixed else "its blocks' smallest chunk")
                                        + ("; its hidden state in host memory between blocks (hidden='host')"
                                           if host else "")),
                    *counted, tensors[0].device if tensors else None)
    if ahead:
        ahead = _planned_ahead(ctx, sig, plan, run, args, kwargs, tensors[0].device, problem)
    shapes_only = ahead and bool(tensors) and tensors[0].device.type == "meta"
    if plan.tier == Tier.L0 or shapes_only:
        # the stock forward fits (or every block fitted stock at the first call): as stock; on meta tensors (a plan
        # on shapes, `streamplan plan`) the rehearsal made every plan and there is nothing to run in chunks
        try:
            with bypass() if "planned ahead" in plan.note or ahead else contextlib.nullcontext():
                return entry.stock(*args, **kwargs)
        except RuntimeError:   # a stock forward that reads a value (no values on meta): the planned run instead
            if not shapes_only:
                raise
    if plan.tier == Tier.L6 and first:   # the host memory its rows need, had before anything runs
        _host_checked(ctx, sig, plan)
    with planned_ahead() if ahead else contextlib.nullcontext():
        out = run(args, kwargs, host=plan.tier == Tier.L6)
    if first and not ahead:   # the model's figures are its largest block's, planned during this first call
        _figures_from_blocks(ctx, plan, before)
    return out


def smallest_planned_chunk(plans: Iterable[Plan], cap: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Rows per chunk of a model forward's own row loops under a budget: its blocks' smallest planned chunk (a block
    kept stock, or a model forward's own plan, has none), at most ``cap``."""
    return min([p.chunk for p in plans if p.tier != Tier.L0 and p.chunk > 0] + [cap])


def _planned_ahead(ctx: CallContext, sig: tuple, plan: Plan, run, args: tuple, kwargs: dict,
                   device: torch.device, problem: str | None) -> bool:
    """Plan the whole forward before it runs (True), or say why it is planned block by block as it runs (False). A
    refusal takes the model's own plan back too: nothing of the call is kept."""
    if problem is None:
        start = time.perf_counter()
        try:
            figures = plan_forward(ctx, run, args, kwargs, device)
        except RehearsalFailed as exc:
            problem = str(exc)
        except Exception:
            ctx.entry.plans.pop(sig, None)
            hooks.release_all(ctx.entry.module)   # what the hooks around this forward brought in, put back
            raise
    if problem is not None:
        ctx.note(f"the whole forward was not planned ahead ({problem}): its blocks plan as they run, each within "
                 "the budget beside what is live then")
        return False
    plan.live_bytes, plan.predicted_peak, plan.stock_peak = 0, figures.predicted, figures.stock or 0
    plan.rows, plan.host_bytes = figures.rows, figures.host_bytes
    plan.note = f"{plan.note}; the whole forward planned ahead (rehearsed on fake tensors): peak {figures.at_peak}"
    plan.tier = Tier.L6 if figures.host else Tier.L1
    if figures.host:
        plan.note = (f"{plan.note}; its hidden state and per-row tables in host memory between blocks (L6), "
                     f"{fmt_bytes(figures.host_bytes)} of host memory at once")
    ctx.note(f"the whole forward rehearsed in {time.perf_counter() - start:.1f} s")   # beside the plan, which is data
    if figures.stock_fits:
        plan.tier = Tier.L0
        plan.note = "model forward: the stock forward fits the budget (planned ahead): the stock forward"
    return True


def _host_checked(ctx: CallContext, sig: tuple, plan: Plan) -> None:
    try:
        host_rows.check_host(plan.host_bytes)
    except HostMemoryError:
        ctx.entry.plans.pop(sig, None)
        hooks.release_all(ctx.entry.module)
        raise


def _figures_from_blocks(ctx: CallContext, plan: Plan, before: set) -> None:
    inner = [p for e in ctx.installed() for p in e.plans.values() if id(p) not in before and p is not plan]
    if not inner:
        return
    worst = max(inner, key=lambda p: p.predicted_total)
    plan.rows, plan.predicted_peak = worst.rows, worst.predicted_total - plan.live_bytes
    plan.stock_peak = max(p.live_bytes + p.stock_peak for p in inner) - plan.live_bytes
    plan.predicted_peak, plan.stock_peak = max(0, plan.predicted_peak), max(0, plan.stock_peak)
    if all(p.tier == Tier.L0 for p in inner):
        plan.tier, plan.note = Tier.L0, "model forward: every block fits stock here: the stock forward"
