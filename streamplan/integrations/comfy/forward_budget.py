"""A size budget on a ComfyUI model forward streamplan runs itself, held over the whole forward: before the first op
runs, the streamed forward is rehearsed on fake tensors by the same machinery that plans diffusers' and transformers'
model forwards (``streamplan.execute.forward_plan``): its blocks plan as they will in the real call, beside every
tensor the forward holds over the rows (hidden state, rotary tables, per-row modulation tables, the head's output),
and the forward's peak is held to the budget. Accepted: the real call runs on those plans. Refused:
``BudgetError`` naming what dominates, with the smallest budget that runs as ``smallest_bytes``; nothing ran, and
the plans the rehearsals made are dropped.

The budget is then the device memory the model call may add above what was allocated when it began (the weights
ComfyUI holds, and the call's inputs, are outside it; per-call weight copies its blocks take are inside it). Only a
size budget is planned ahead, and only without ``chunk_tokens`` (as for ``streamplan.apply``); "auto" and None keep
their per-block meaning (``memory``). A forward that cannot be rehearsed plans block by block as it runs, noted."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...execute.call_state import planned_ahead, shapes
from ...execute.context import CallContext
from ...execute.forward_plan import plan_forward
from ...execute.model_call import smallest_planned_chunk
from ...execute.rehearsal import RehearsalFailed
from ...plan.budget import fmt_bytes
from .forward_loops import DEFAULT_CHUNK
from .weights import quantized_layers

log = logging.getLogger("streamplan")


class _NoHostRows:
    host_rows = False   # the hidden state stays on the device (no L6 for ComfyUI's forwards)


@dataclass(eq=False)
class ForwardEntry:
    """The model forward as ``forward_plan`` reads an installed one: its module, its stock call (not rehearsed: the
    streamed forward runs at every budget, its blocks kept stock where they fit), no plans of its own."""

    module: nn.Module
    name: str = ""
    spec: Any = field(default_factory=_NoHostRows)
    plans: dict = field(default_factory=dict)

    @staticmethod
    def stock(*args: Any, **kwargs: Any) -> Any:
        raise RehearsalFailed("ComfyUI's stock forward is not rehearsed (the streamed forward runs at every budget)")


def plans_ahead(forward: Any, options: Any) -> bool:
    """Whether this call's forward is planned whole before it runs: a size budget, no fixed chunk, and a forward
    that declares it can be rehearsed (``plans_ahead``)."""
    budget = options.budget
    return (getattr(forward, "plans_ahead", False) and isinstance(budget, int) and not isinstance(budget, bool)
            and not options.chunk_tokens)


def ahead_problem(state: Any, model: nn.Module) -> str | None:
    """Why this model's forward is not planned ahead (None: it is): a block left to another node's replacement would
    be run on fake tensors (what it does there is its own); quantized layouts take row chunks only, never a byte
    budget (``patch``), so no plan of them can be held to one."""
    if state.left:
        return (f"{len(state.left)} block(s) left to another node's replacement: the forward is not planned ahead; "
                "streamplan's blocks plan as they run")
    for name, blocks in model.named_children():   # every block list (blocks, transformer_blocks, double_blocks, ...)
        if not isinstance(blocks, nn.ModuleList):
            continue
        for i, block in enumerate(blocks):
            found = quantized_layers(block)
            if found:
                return (f"{name}[{i}] holds quantized weights ({found[0]}, ...): they take row chunks only, so the "
                        "forward is not planned ahead; its other blocks plan as they run")
    return None


def _block_entries(state: Any) -> list:
    return [b.streamer.entry for b in state.blocks.values()
            if b.streamer is not None and b.streamer.entry is not None]


def _block_plans(state: Any) -> list:
    return [p for e in _block_entries(state) for p in e.plans.values()]


def loop_chunk(state: Any) -> int:
    """Rows per chunk of a planned-ahead forward's own loops: its blocks' smallest planned chunk (as a diffusers or
    transformers forward planned ahead takes), at most ComfyUI's default loop chunk. Before its blocks planned (the
    rehearsal's input projection) the default: the real call's chunk is never larger than the rehearsal's."""
    return smallest_planned_chunk(_block_plans(state), DEFAULT_CHUNK)


def _context(state: Any, model: nn.Module) -> CallContext:
    entry = ForwardEntry(model, type(model).__name__)

    def note(text: str) -> None:
        if text not in state.forward.notes:
            state.forward.notes.append(text)
            log.info("streamplan.integrations.comfy: %s: %s", type(model).__name__, text)

    def no_plan(*_: Any, **__: Any) -> Any:
        raise RuntimeError("streamplan: a ComfyUI model forward has no plan of its own")

    return CallContext(entry, state.plan_options, note, no_plan,
                       lambda: [entry, *_block_entries(state)])


def run_planned(state: Any, model: nn.Module, run: Callable[[tuple, dict], Any], args: tuple,
                kwargs: dict, read_ahead: Callable[[], None] | None = None) -> Any:
    """``run(args, kwargs)`` (the streamed forward) with the whole forward planned ahead under the size budget, once
    per input signature and sampling run; ``BudgetError`` before anything runs where it cannot hold. ``read_ahead``:
    called on the real call before a rehearsal, to read the values the forward decides on (a fake tensor has none)."""
    calls = state.forward
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    why = "the call has no tensor argument" if not tensors else ahead_problem(state, model)
    if why:
        if why not in calls.notes:
            calls.notes.append(why)
        return run(args, kwargs)
    device = tensors[0].device
    sig = (shapes(args, kwargs), tensors[0].dtype, str(device))
    calls.loop_chunk = loop_chunk   # the rehearsal's own loops take the chunk the real call's will
    try:
        return _planned_run(state, model, run, args, kwargs, sig, device, read_ahead)
    finally:
        calls.loop_chunk = None


def _planned_run(state: Any, model: nn.Module, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict,
                 sig: tuple, device: torch.device, read_ahead: Callable[[], None] | None) -> Any:
    calls = state.forward
    if sig not in calls.planned:
        if read_ahead is not None:
            read_ahead()
        ctx = _context(state, model)
        start = time.perf_counter()
        try:
            figures = plan_forward(ctx, lambda a, k, host=False: run(a, k), args, kwargs, device)
        except RehearsalFailed as exc:
            ctx.note(f"the whole forward was not planned ahead ({exc}): its blocks plan as they run, each within the "
                     "budget above what its call holds when entered")
            figures = None
        calls.planned[sig] = figures
        if figures is not None:
            ctx.note(f"the whole forward planned ahead under {fmt_bytes(figures.budget)} (rehearsed on fake tensors "
                     f"in {time.perf_counter() - start:.1f} s): predicted peak {fmt_bytes(figures.predicted)} "
                     f"above the call's start, {figures.at_peak}")
    figures = calls.planned[sig]
    if figures is None:
        calls.loop_chunk = None   # planned as it runs: the loops' chunk from the room, as without planning ahead
        return run(args, kwargs)
    before = {id(p) for p in _block_plans(state)}
    with planned_ahead():
        out = run(args, kwargs)
    unplanned = [e.name for e in _block_entries(state) if any(id(p) not in before for p in e.plans.values())]
    if unplanned:   # a call the rehearsal did not see planned on its own: said, never silent
        note = (f"{', '.join(unplanned)} planned during the real call (a call the rehearsal did not make): "
                "planned within the budget above what its call held when entered")
        if note not in calls.notes:
            calls.notes.append(note)
        log.warning("streamplan.integrations.comfy: %s", note)
    return out


__all__ = ["ForwardEntry", "loop_chunk", "plans_ahead", "run_planned"]
