"""The whole model forward planned before its first op runs: under a budget, a model forward streamplan runs itself is
rehearsed on fake tensors (``rehearsal``), its blocks planning as they will in the real call, and its peak (every
tensor the forward holds over the rows beside each block's work) held to the budget. Accepted: the real call reuses
those plans. Refused: ``BudgetError`` with the smallest budget that runs, before anything ran; the plans made in the
rehearsals are dropped.

A model forward's budget is the device memory the call may add above what was allocated when it started."""
from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import hook_chains as hooks
from .call_state import bypass, rehearsal_settings
from .context import CallContext
from .rehearsal import Rehearsed, RehearsalFailed, rehearsal_problem, rehearse
from ..plan.budget import auto_budget, fmt_bytes, stranded_blocks_note
from ..plan.planner import BudgetError

log = logging.getLogger("streamplan")

_SMALLEST_SAID = re.compile(r" \(the smallest budget that runs it: [^)]*\)")

MARGIN = 0.03          # the smallest budget leaves its parts this much room, as a block plan keeps under its budget
FORWARD_MARGIN = 0.06  # a forward plans under this much less than its budget: what neither the fake run nor the parts'
#                        memory models see (docs/budgets-and-tiers.md, Calibration)
FIT_TRIES = 3          # rehearsals that may lower the parts' budget by what a forward's peak came out over it
SMALLEST_TRIES = 4     # rehearsals that may raise a found smallest budget before it is said


@dataclass
class ForwardFigures:
    """What planning the forward ahead found: the predicted peak it adds and stock's, and where the peak falls."""

    predicted: int
    stock: int | None    # the stock forward's peak, where known
    at_peak: str
    rows: int = 0
    budget: int = 0
    host: bool = False   # L6: the hidden state in host memory between blocks
    host_bytes: int = 0  # host memory the forward holds at once (L6's rows, L4's K/V stores)

    @property
    def stock_fits(self) -> bool:
        return not self.host and self.stock is not None and self.stock <= held(self.budget)


def forward_problem(module: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why the forward cannot be rehearsed (None: it can): a hook that does more than move weights would have to run
    on fake tensors (and keep them), or a cache already holds tensors. Weight movers are set aside in the rehearsal,
    their weights stood in and counted (``hook_chains.weights_in_flight``)."""
    for name, m in module.named_modules():
        found = hooks.rehearsal_problem(m)
        if found:
            return f"{name or 'the model'} has {found}"
    return rehearsal_problem(args, kwargs)


def budget_bytes(ctx: CallContext, device: torch.device) -> int:
    budget = ctx.options.budget
    return auto_budget(device, ctx.options.reserve) if budget == "auto" else int(budget)


def plan_forward(ctx: CallContext, run: Callable[..., Any], args: tuple, kwargs: dict,
                 device: torch.device) -> ForwardFigures:
    """Rehearse the streamed forward under the budget; keep its plans when its peak fits, else raise ``BudgetError``
    with the smallest budget that runs (or, under ``smallest_when_short``, keep the plans at that smallest). The
    hidden state goes to host memory (L6, ``run(..., host=True)``) only where the forward can keep it there and the
    budget is below what it reaches with the hidden state on the device."""
    budget = budget_bytes(ctx, device)
    if (stranded := stranded_blocks_note(device)) is not None:
        ctx.note(stranded)
    before = _plan_keys(ctx)
    why = ""
    for host in host_ladder(ctx):
        attempt = functools.partial(_attempt, ctx, run, args, kwargs, device, before, host=host)
        try:
            figures = _fitted(ctx, attempt, budget, before)
            if figures.predicted <= held(budget):
                figures.budget = budget
                if figures.host or (not figures.stock_fits and figures.stock is not None):   # stock cannot fit:
                    return figures                                                          # not rehearsed
                figures.stock = _larger(_stock_peak(ctx, args, kwargs, device), figures.stock)
                return figures
            why = f"its peak would be {fmt_bytes(figures.predicted)}, {figures.at_peak}"
            _drop_new(ctx, before)
        except BudgetError as exc:   # the forward's smallest follows
            said = _SMALLEST_SAID.sub('', str(exc)).rstrip('.')
            why = said if getattr(exc, "whole_forward", False) else f"a part of it refused: {said}"
    if host:
        why += " (with its hidden state in host memory between blocks)"
    smallest = _smallest(ctx, attempt, before)
    if smallest <= budget:   # the planner's pick overshot, every part at its smallest fits: a budget at or above the
        figures = attempt(least=True)   # smallest a refusal names never refuses
        if figures.predicted <= held(budget):
            figures.budget = budget
            return figures
        _drop_new(ctx, before)
    if ctx.options.smallest_when_short:
        figures = attempt(least=True)
        ctx.note(f"the budget {fmt_bytes(budget)} is below the smallest this forward reaches: planned at that smallest "
                 f"({fmt_bytes(figures.predicted)} predicted) instead of refusing")
        figures.budget = budget   # its parts' stock (a lower bound of stock's peak) is over the smallest already
        return figures
    raise BudgetError(
        f"{type(ctx.entry.module).__name__}: the budget {fmt_bytes(budget)} cannot hold the whole forward (planned "
        f"ahead on fake tensors, nothing ran): {why}. The smallest budget that runs it: {fmt_bytes(smallest)} "
        "(BudgetError.smallest_bytes); or shorten the sequence, or lower the batch", smallest_bytes=smallest)


def host_ladder(ctx: CallContext) -> tuple[bool, ...]:
    """Where the forward's hidden state may be tried, in order (False: on the device; True: in host memory, L6)."""
    if not ctx.entry.spec.host_rows or ctx.options.hidden == "device":
        return (False,)
    return (True,) if ctx.options.hidden == "host" else (False, True)


def _attempt(ctx: CallContext, run, args: tuple, kwargs: dict, device: torch.device, before: set,
             budget: int | None = None, least: bool = False, host: bool = False) -> ForwardFigures:
    """One rehearsal under ``budget`` (None: the options'), every part at its smallest plan if ``least``, the hidden
    state in host memory if ``host``; the plans it makes stay when it returns. Its prediction is the larger of the
    ledger's peak and each planned call's predicted peak beside what was live then."""
    weights = hooks.weights_in_flight(ctx.entry.module)   # brought in by offload or casting hooks: beside it all
    if budget is not None and budget <= weights:
        exc = BudgetError(f"the weights its hooks bring in at once ({fmt_bytes(weights)}) are more than the budget "
                          f"leaves for the forward ({fmt_bytes(budget)} after its margin): none is left for its work")
        exc.whole_forward = True
        raise exc
    try:
        with rehearsal_settings(budget=None if budget is None else max(1, budget - weights), least=least):
            found = rehearse(functools.partial(run, host=host), args, kwargs, device, ctx.entry.module)
    except BaseException:
        _drop_new(ctx, before)
        raise
    planned = [p for e, sig, p in _plans(ctx) if (id(e), sig) not in before]
    stock = max((p.live_bytes + p.stock_peak for p in planned), default=0)   # each part's stock, by its model
    return ForwardFigures(weights + max([found.peak, *(p.predicted_total for p in planned)]), weights + stock,
                          _with_weights(found.describe(), weights), max((p.rows for p in planned), default=0),
                          host=host, host_bytes=found.host_peak)


def _with_weights(at_peak: str, weights: int) -> str:
    return f"{at_peak}; beside {fmt_bytes(weights)} of weights its hooks bring in" if weights else at_peak


def _smallest(ctx: CallContext, attempt: Callable[..., ForwardFigures], before: set) -> int:
    """The smallest budget under which the forward's rehearsal fits: its peak with every part at its smallest plan,
    checked by rehearsing under it (raised while a rehearsal there still does not fit)."""
    least = attempt(least=True)
    _drop_new(ctx, before)
    smallest = _above(least.predicted)
    for _ in range(SMALLEST_TRIES):
        try:
            found = _fitted(ctx, attempt, smallest, before)
            fits = found.predicted <= held(smallest)
            _drop_new(ctx, before)
        except BudgetError:
            found, fits = None, False
        if fits:
            break
        smallest = max(_above(found.predicted) if found else 0, math.ceil(smallest * 1.05))
    return smallest


def _fitted(ctx: CallContext, attempt: Callable[..., ForwardFigures], budget: int, before: set) -> ForwardFigures:
    """A rehearsal whose parts plan under the held budget; where its peak still comes out over (tensors beside a
    call that its plan does not see: a per-chunk table's own intermediates, say), again with the parts' budget
    lowered by the overshoot. The last rehearsal's plans stay."""
    target = parts = held(budget)
    for _ in range(FIT_TRIES):
        figures = attempt(budget=parts)
        over = figures.predicted - target
        if over <= 0 or parts - over - target // 100 <= 0:
            return figures
        _drop_new(ctx, before)
        parts -= over + target // 100
    return attempt(budget=parts)


def held(budget: int) -> int:
    """What a forward is planned under for a budget: less its margin."""
    return int(budget * (1 - FORWARD_MARGIN))


def _above(peak: int) -> int:
    """The smallest budget whose plans leave ``peak`` its margins."""
    return math.ceil(peak / (1 - MARGIN) / (1 - FORWARD_MARGIN)) + 1


def _larger(rehearsed: int | None, modelled: int | None) -> int | None:
    """Stock's peak: the stock rehearsal's (None where it could not run: then unknown), or the parts' own stock
    estimates where larger (kernels' scratch the fake run cannot see)."""
    return None if rehearsed is None else max(rehearsed, modelled or 0)


def _stock_peak(ctx: CallContext, args: tuple, kwargs: dict, device: torch.device) -> int | None:
    """The stock forward's peak by the same ledger (every streamed module bypassed), or None where it cannot be had."""
    try:
        with bypass():
            found = rehearse(lambda a, k: ctx.entry.stock(*a, **k), args, kwargs, device, ctx.entry.module)
        return found.peak + hooks.weights_in_flight(ctx.entry.module)
    except (RehearsalFailed, RuntimeError, NotImplementedError) as exc:
        log.debug("streamplan: stock forward not rehearsed: %s", exc)
        return None


def _plans(ctx: CallContext):
    for e in ctx.installed():
        for sig, p in list(e.plans.items()):
            if e is not ctx.entry:
                yield e, sig, p


def _plan_keys(ctx: CallContext) -> set:
    return {(id(e), sig) for e, sig, _ in _plans(ctx)}


def _drop_new(ctx: CallContext, before: set) -> None:
    """Forget the plans made since ``before`` (a rehearsal's, refused or only a step of the smallest's search)."""
    for e in ctx.installed():
        if e is ctx.entry:
            continue
        for sig in [s for s in e.plans if (id(e), s) not in before]:
            del e.plans[sig]


__all__ = ["ForwardFigures", "Rehearsed", "RehearsalFailed", "budget_bytes", "forward_problem", "plan_forward"]
