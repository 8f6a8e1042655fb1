"""``apply`` and the reversible ``StreamHandle`` (in the manner of accelerate's hooks): installation, planning
per call signature, removal. How each spec type runs lives in ``streamplan.execute.dispatch``; the report in
``report``."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .execute import hook_chains as hooks
from . import report as _report
from .plan.budget import DEFAULT_RESERVE, auto_budget, fmt_bytes
from .execute import call_ledger
from .execute.call_state import BYPASS, REHEARSAL, ROOT, bypass, live_bytes, outermost, rehearsing, within
from .attention import consumer_for
from .execute.chunk_loop import drain_retries
from .specs import (DESCRIBED_MARK, MODEL_MARK, STREAMED_MARK, AttentionSpec, GraphSpec, MLPSpec, ModelSpec, Skip,
                    described_whole)
from .options import StreamOptions
from .plan.planner import BudgetError, Plan, Tier
from .integrations.recognizers import recognize
from .registries import pipeline_parts
from .execute.context import CallContext
from .execute.dispatch import run_spec
from .execute.stock_watch import StockWatch, activation_bytes, watch_candidates
from .execute.compare import NotCopyable, compare_outputs, output_tensors, private_copy

__all__ = ["apply", "bypass", "BlockStreamer", "StreamHandle", "StreamOptions"]

log = logging.getLogger("streamplan")

_MISSING = object()
PLAN_MARGIN = 0.03   # plans aim this far under the budget: allocator rounding and what the memory model misses
SLOW_PLAN = 1.5     # a plan the time model predicts slower than this against stock is logged as slow when planned

@dataclass(eq=False)
class Installed:
    name: str
    module: nn.Module
    spec: MLPSpec | AttentionSpec | GraphSpec
    stock: Callable[..., Any]
    previous: Any  # what module.__dict__["forward"] held before, or _MISSING
    wrapper: Any = None  # the forward streamplan installed
    plans: dict[tuple, Plan] = field(default_factory=dict)
    runtime_notes: list[str] = field(default_factory=list)
    kv_errors: dict[tuple, Any] = field(default_factory=dict)   # L5: per signature, the error against exact K/V


def _restore(module: nn.Module, wrapper: Any, previous: Any) -> None:
    """Put back what ``module.forward`` held before streamplan, unless someone wrapped it since (then theirs stays:
    it still calls ours, which now runs stock via the bypass-free stock path). Inside a diffusers hook chain (installed
    there, or moved there by hooks registered after ``apply``) only streamplan's link is taken out."""
    current = module.__dict__.get("forward", _MISSING)
    if current is not wrapper and wrapper is not None and hooks.uninstall(
            module, wrapper, type(module).forward.__get__(module) if previous is _MISSING else previous):
        return
    if current is not wrapper and wrapper is not None:
        log.warning("streamplan: %s.forward was replaced after apply; leaving the newer forward in place",
                    type(module).__name__)
        return
    if previous is _MISSING or (getattr(previous, "__self__", None) is module
                                and getattr(previous, "__func__", None) is type(module).forward):
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


# every handle still in force, by its root: a later ``apply`` over the same modules supersedes it
_LIVE: "weakref.WeakKeyDictionary[nn.Module, StreamHandle]" = weakref.WeakKeyDictionary()


def live_handle(model: nn.Module) -> "StreamHandle | None":
    """The handle streaming ``model`` now, if any (``verify`` notes its extra memory there)."""
    return _LIVE.get(model)


class StreamHandle:
    """What ``apply`` installed; ``remove()`` puts every forward back as it was."""

    def __init__(self, root: nn.Module, options: StreamOptions, skipped: list[Skip]):
        self.root = root
        self.options = options
        self.skipped = skipped
        self.installed: dict[str, Installed] = {}
        self.removed = False
        self.self_checked = False
        self.superseded_by: StreamHandle | None = None
        self.watched: dict[str, StockWatch] = {}
        self.calls: list = []      # ``call_ledger.CallRecord`` of each streamed module call of the last call
        self._calls_of = -1        # the outermost call those records belong to (``ROOT.calls``)
        self.call_inputs = 0       # bytes of that outermost call's inputs
        self.checks: list[str] = []   # what checks run beside the streamed calls took (``verify``), for the report
        self._root_previous: Any = None
        self._root_wrapper: Any = None

    # -- installation -------------------------------------------------------------------------------
    def _install(self, name: str, spec: MLPSpec | AttentionSpec | GraphSpec) -> None:
        module = spec.module
        previous = module.__dict__.get("forward", _MISSING)
        stock = module.forward
        entry = Installed(name, module, spec, stock, previous)

        @functools.wraps(type(module).forward)
        def streamed_forward(*args: Any, **kwargs: Any) -> Any:
            if BYPASS.active:
                args, kwargs = described_whole(args, kwargs)
                return entry.stock(*args, **kwargs)
            if torch.compiler.is_compiling():   # inside a compiled module (its parts): dynamo would trace the chunks
                self.note(entry, "called under torch.compile: ran stock")
                args, kwargs = described_whole(args, kwargs)
                return entry.stock(*args, **kwargs)
            if entry.module.training:   # checked per call: train() after apply must get the stock behaviour back
                self.note(entry, "in training mode: ran stock (streamplan is for inference: call .eval())")
                args, kwargs = described_whole(args, kwargs)
                return entry.stock(*args, **kwargs)
            with outermost(args, kwargs):
                return self._run(entry, args, kwargs)

        setattr(streamed_forward, STREAMED_MARK, True)
        if isinstance(spec, GraphSpec):   # a model forward may hand it masks over rows described (ir.RowMask)
            setattr(streamed_forward, DESCRIBED_MARK, True)
        setattr(streamed_forward, MODEL_MARK, isinstance(spec, ModelSpec))
        inner = hooks.install(module, streamed_forward)   # inside the module's diffusers hooks, where stock ran
        if inner is None:
            module.forward = streamed_forward
        else:   # the stock fallback is the link replaced, not the chain (which would come back here)
            entry.stock = entry.previous = inner
            entry.runtime_notes.append(f"runs inside hooks: {', '.join(hooks.hook_names(module))}")
        entry.wrapper = streamed_forward
        self.installed[name] = entry

    def _watch(self, name: str, module: nn.Module) -> None:
        """Estimate a stock module's output at each call (report, predicted peak) and hold it to a byte budget."""
        watch = StockWatch(name, module, module.__dict__.get("forward", _MISSING))
        stock = module.forward

        @functools.wraps(type(module).forward)
        def watched_forward(*args: Any, **kwargs: Any) -> Any:
            estimate = activation_bytes(module, args, kwargs)
            if estimate is not None and not BYPASS.active:
                x = args[0] if args else next(iter(kwargs.values()))
                available, live = self._available(args, kwargs, x.device)
                watch.record(estimate, live, tuple(x.shape))
                budget = self.options.budget if REHEARSAL.budget is None else REHEARSAL.budget
                checked = REHEARSAL.least or REHEARSAL.ahead   # by the forward's rehearsal instead
                if isinstance(budget, int) and not checked and estimate > max(0, available):
                    smallest = _smallest_budget(live, estimate)
                    raise BudgetError(
                        f"{name} ({type(module).__name__}) runs stock (streamplan does not stream it) and its output "
                        f"alone is {fmt_bytes(estimate)} for input {list(x.shape)}, more than the budget "
                        f"{fmt_bytes(budget)} leaves beside its live inputs ({fmt_bytes(live)}). Raise "
                        "the budget, shorten the sequence or lower the batch; for a causal LM ask for fewer logits "
                        f"(logits_to_keep=1, as generate does){_smallest_said(smallest)}.", least=estimate,
                        smallest_bytes=smallest)
            return stock(*args, **kwargs)

        setattr(watched_forward, STREAMED_MARK, True)
        module.forward = watched_forward
        watch.wrapper = watched_forward
        self.watched[name] = watch

    def _track_root(self) -> None:
        """Wrap the root's forward (when nothing streamed sits there) so memory the model allocates between
        streamed modules, not passed to them, is seen by their plans (on CUDA, from the allocator)."""
        module = self.root
        previous = module.__dict__.get("forward", _MISSING)
        stock = module.forward

        @functools.wraps(type(module).forward)
        def tracked_forward(*args: Any, **kwargs: Any) -> Any:
            with outermost(args, kwargs):
                return stock(*args, **kwargs)

        module.forward = tracked_forward
        self._root_previous = previous
        self._root_wrapper = tracked_forward

    def _run(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        record = self._record(entry, args, kwargs)
        with call_ledger.recorded(record):
            return self._run_recorded(entry, args, kwargs, record)

    def _run_recorded(self, entry: Installed, args: tuple, kwargs: dict, record: Any) -> Any:
        checking = (self.options.self_check and not self.self_checked and not isinstance(entry.spec, ModelSpec)
                    and not rehearsing())
        if checking:  # the reference runs stock on private copies: the caller's inputs and caches stay as they are
            with call_ledger.phase("self-check: stock"):
                try:
                    ref_args, ref_kwargs = private_copy(args), private_copy(kwargs)
                except NotCopyable as e:
                    checking = False
                    self.note(entry, f"self-check not run: {e}")
                else:
                    with bypass():
                        ref_args, ref_kwargs = described_whole(ref_args, ref_kwargs)
                        ref = entry.stock(*ref_args, **ref_kwargs)
                    del ref_args, ref_kwargs
        with within(entry.name or "<root>"):
            out = run_spec(self._context(entry, record), args, kwargs)
        for a, b in drain_retries():
            self.note(entry, f"out of memory on rows [{a}:{b}): retried in halves")
        if checking and any(p.tier != Tier.L0 for p in entry.plans.values()):
            self._self_check(entry, out, ref)
        return out

    def _record(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        """A record of this call in the handle's ledger of its last call (``timeline``), or None in a rehearsal (fake
        tensors, no memory). The first record of a new outermost call starts the ledger anew."""
        if rehearsing():
            return None
        if self._calls_of != ROOT.calls or len(self.calls) >= call_ledger.MAX_RECORDS:
            self.calls, self._calls_of, self.call_inputs = [], ROOT.calls, ROOT.inputs
        # its inputs counted only while the meter's profiler runs (a plan knows them already; a cache's tensors are
        # many, and decoding calls every layer once a token)
        inputs = live_bytes(args, kwargs) if call_ledger.profiling() else 0
        record = call_ledger.new_record(entry.name, type(entry.module).__name__, inputs)
        self.calls.append(record)
        return record

    def _context(self, entry: Installed, record: Any = None) -> CallContext:
        """What a handler gets: this entry, the options, the entry's notes as a sink, planning under the budget (the
        plan a call runs kept in its ledger record)."""
        plan = functools.partial(self.plan_for, entry)
        if record is not None:
            def plan(sig: tuple, *rest: Any, **kw: Any) -> Plan:
                made = self.plan_for(entry, sig, *rest, **kw)
                if not rehearsing():
                    record.saw(made, sig)
                return made
        return CallContext(entry, self.options, functools.partial(self.note, entry), plan,
                           lambda: list(self.installed.values()))

    def _self_check(self, entry: Installed, out: Any, ref: Any) -> None:
        """Once per handle: the first streamed call is also run stock, and the difference is logged and kept, with
        the extra memory the check took (stock's peak first, then stock's output held beside the streamed call)."""
        self.self_checked = True
        diffs = compare_outputs(out, ref)
        worst = max((d["rel"] for d in diffs.values()), default=0.0)
        held = sum(t.numel() * t.element_size() for t in output_tensors(ref).values())
        plans = list(entry.plans.values())
        stock = max((p.live_bytes + p.stock_peak for p in plans), default=0)
        note = (f"self-check against stock on the first call: max relative difference {worst:.2e} (its extra memory: "
                f"that call ran stock first, at stock's peak, est. {fmt_bytes(stock)} with its inputs, then held "
                f"stock's output, {fmt_bytes(held)}, beside the streamed call)")
        if note not in entry.runtime_notes:   # noted here and logged once, at the level the difference calls for
            entry.runtime_notes.append(note)
        (log.warning if worst > 1e-2 else log.info)("streamplan: %s: %s", entry.name or type(entry.module).__name__,
                                                    note)

    def _available(self, args: tuple, kwargs: dict, device: torch.device | None) -> tuple[int | None, int]:
        """(bytes this call may use, bytes alive around it). A byte budget covers the model's inputs and what the
        model allocated before this call (on CUDA, read from the allocator since the outermost call began; on CPU,
        which has no such counter, the call's own inputs; in a model forward's rehearsal, what its ledger counts the
        forward has added); "auto" is what the device has free now."""
        live = live_bytes(args, kwargs)
        if REHEARSAL.ledger is not None:
            live = max(live, REHEARSAL.ledger.current)
        elif device is not None and device.type == "cuda" and ROOT.depth:
            live = max(live, torch.cuda.memory_allocated(device) - ROOT.base + ROOT.inputs)
        budget = self.options.budget if REHEARSAL.budget is None else REHEARSAL.budget
        if budget is None:
            return None, live
        if budget == "auto":
            return int(auto_budget(device, self.options.reserve) * (1 - PLAN_MARGIN)), live
        return int((budget - live) * (1 - PLAN_MARGIN)), live

    def _budget_said(self) -> str:
        """The budget a part was planned under, as a refusal names it: in a forward's rehearsal, what was left for
        its parts (the weights its hooks bring in, and any re-plan's overshoot, taken off the caller's budget)."""
        given = self.options.budget
        said = "auto" if given == "auto" else fmt_bytes(given)
        if REHEARSAL.budget is not None and REHEARSAL.budget != given:
            return f"{fmt_bytes(REHEARSAL.budget)} (what the forward's budget, {said}, leaves for its parts)"
        return said

    def plan_for(self, entry: Installed, sig: tuple, make: Callable[[int | None], Plan], args: tuple = (),
              kwargs: dict | None = None, device: torch.device | None = None) -> Plan:
        plan = entry.plans.get(sig)
        if plan is None:
            available, live = self._available(args, kwargs or {}, device)
            if available is not None and REHEARSAL.least:   # the smallest budget's rehearsal
                plan = _least_plan(make, 0)
            elif available is not None and self.options.smallest_when_short:
                plan = _smallest_when_short(self, entry, make, available)
            elif available is not None and available <= 0:
                smallest = _smallest_budget(live, _least(make))
                raise BudgetError(f"{entry.name or type(entry.module).__name__}: the budget "
                                  f"{self._budget_said()} is already taken by the call's inputs "
                                  f"({fmt_bytes(live)}); nothing is left for its work"
                                  + _smallest_said(smallest), smallest_bytes=smallest)
            try:
                plan = plan or make(available)
            except BudgetError as exc:
                smallest = _smallest_budget(live, exc.least)
                raise BudgetError(f"{entry.name or type(entry.module).__name__}: budget {self._budget_said()} "
                                  f"less its live inputs ({fmt_bytes(live)}) cannot hold it. {exc}. Raise the "
                                  "budget, shorten the sequence, or lower the batch" + _smallest_said(smallest)
                                  + ".", least=exc.least, smallest_bytes=smallest) from None
            plan.live_bytes, plan.budget = live, available
            entry.plans[sig] = plan
            log.info("streamplan: %s planned for %s: %s; predicted %s with its inputs (%s), stock est. %s",
                     entry.name or type(entry.module).__name__, sig[0], plan.describe(figures=False),
                     fmt_bytes(plan.predicted_total), fmt_bytes(live), fmt_bytes(live + plan.stock_peak))
            if (plan.predicted_time_ratio or 0) > SLOW_PLAN and available is not None:
                log.warning("streamplan: %s: the fastest plan under this budget is predicted at %.2fx stock's time "
                            "(%s); a larger budget runs faster%s", entry.name or type(entry.module).__name__,
                            plan.predicted_time_ratio, plan.describe(figures=False),
                            f" ({_report.host_bound_said(plan)})" if _report.host_bound(plan) else "")
        return plan

    @staticmethod
    def note(entry: Installed, note: str) -> None:
        if note not in entry.runtime_notes:
            entry.runtime_notes.append(note)
            log.info("streamplan: %s: %s", entry.name, note)

    # -- public -------------------------------------------------------------------------------------
    @property
    def plans(self) -> dict[str, list[Plan]]:
        return {name: list(e.plans.values()) for name, e in self.installed.items()}

    def remove(self) -> None:
        """Restore the stock forwards (the same function objects as before ``apply``). Removing a handle that a
        later ``apply`` superseded removes that later handle too: either handle gives the stock model back."""
        if self.superseded_by is not None:
            self.superseded_by.remove()
        if self._root_previous is not None:
            _restore(self.root, self._root_wrapper, self._root_previous)
            self._root_previous = None
        for entry in list(self.installed.values()) + list(self.watched.values()):
            _restore(entry.module, entry.wrapper, entry.previous)
        self.installed.clear()
        self.watched.clear()
        self.removed = True
        if _LIVE.get(self.root) is self:
            del _LIVE[self.root]

    def predicted_peak(self) -> int:
        """The largest predicted peak of any planned call or of a stock module's output seen so far, its live
        inputs included (what a budget covers)."""
        planned = (p.predicted_total for plans in self.plans.values() for p in plans)
        return max(max(planned, default=0), max((w.total for w in self.watched.values()), default=0))

    def to_json(self) -> str:
        return _report.to_json(self)

    def report(self) -> str:
        """What was streamed and how (a table per input signature), and what was left stock and why."""
        return _report.render(self)

    def timeline(self, path: str | None = None, *, stock_peak: int | None = None, title: str = "") -> Any:
        """The memory picture of the last call: per streamed module call and phase, the predicted peak and its parts
        (inputs, K/V, whole buffers such as the residual's next value, a chunk's transient), the stock estimate, and
        the measured peaks where the call ran under the profiler-based meter (``streamplan.measure_peak`` on CPU,
        ``meter.profiler_peak`` on CUDA). ``path``: also written there as one self-contained HTML file (inline SVG,
        no network); ``stock_peak``: stock's measured peak for the same call, above its inputs, drawn beside it.
        Returns the ``timeline.Timeline`` (its figures, as drawn)."""
        from . import timeline as _timeline
        found = _timeline.from_handle(self, stock_peak=stock_peak, title=title)
        if path is not None:
            _timeline.write_html([found], path)
        return found

    def __repr__(self) -> str:  # noqa: D105
        return f"<StreamHandle {len(self.installed)} streamed, {len(self.skipped)} left stock>"


def _keywords_besides_options(arguments: dict) -> list[str]:
    """The ``apply`` keywords given a value other than their default, beside ``options``."""
    params = inspect.signature(apply).parameters
    return [name for name, p in params.items() if name not in ("module", "options")
            and arguments[name] is not p.default and arguments[name] != p.default]


def _supersede(root: nn.Module) -> list["StreamHandle"]:
    """A second ``apply`` over modules an earlier handle streams takes them over with its own options: the earlier
    handle is removed first (and its ``remove()`` later removes the newer one too). Applying to a part of a model
    that is streamed as a whole is refused: the whole model's handle owns its forward."""
    mods = set(map(id, root.modules()))
    for other_root, other in list(_LIVE.items()):
        if other.removed or id(other_root) in mods:
            continue
        if any(m is root for m in other_root.modules()):
            raise ValueError(f"{type(root).__name__} is part of {type(other_root).__name__}, which a streamplan "
                             f"handle already streams ({other!r}); call that handle's remove() first, or apply to "
                             f"{type(other_root).__name__} again to re-plan all of it")
    superseded = [h for r, h in list(_LIVE.items()) if not h.removed and id(r) in mods]
    for other in superseded:
        other.remove()
    return superseded


def _least(make: Callable[[int | None], Plan]) -> int | None:
    """The smallest peak the planner reaches for an operation (its refusal of a zero budget says it), or None."""
    try:
        make(0)
    except BudgetError as exc:
        return exc.least
    return None


def _smallest_budget(live: int, least: int | None) -> int | None:
    """The smallest byte budget under which an operation whose smallest peak is ``least`` plans, beside ``live``
    bytes of live inputs: what ``_available`` leaves after the plan margin covers ``least``."""
    if least is None:
        return None
    return live + math.ceil(least / (1 - PLAN_MARGIN)) + 1


def _smallest_said(smallest: int | None) -> str:
    return f" (the smallest budget that runs it: {fmt_bytes(smallest)}, BudgetError.smallest_bytes)" if smallest else ""


def _smallest_when_short(handle: "StreamHandle", entry: Installed, make: Callable[[int | None], Plan],
                         available: int) -> Plan:
    """Under ``smallest_when_short``: the plan for ``available`` where one fits (planned as usual), else the plan at
    the smallest peak the planner reaches (the least budget it plans under, found by bisection on its own memory model;
    planning is arithmetic, no work runs), noted on the entry."""
    if available > 0:
        try:
            return make(available)
        except BudgetError:
            pass
    plan = _least_plan(make, available)
    handle.note(entry, f"the budget left {fmt_bytes(max(0, available))} for it, below the smallest peak it reaches: "
                       f"planned at that smallest peak ({fmt_bytes(plan.predicted_peak)}) instead of refusing")
    return plan


def _least_plan(make: Callable[[int | None], Plan], available: int) -> Plan:
    """The plan at the smallest peak the planner reaches, found by bisection on its own memory model from a budget
    it refused (``available``): planning is arithmetic, no work runs."""
    lo, hi = max(0, available), max(2 * available, 2**20)
    while True:   # a budget the planner fits (its stock estimate bounds it)
        try:
            plan = make(hi)
            break
        except BudgetError:
            lo, hi = hi, hi * 2
            if hi > 2**62:
                raise
    while hi - lo > max(2**10, hi // 1000):
        mid = (lo + hi) // 2
        try:
            plan, hi = make(mid), mid
        except BudgetError:
            lo = mid
    return plan


class BlockStreamer:
    """Streams the calls one caller makes to a block, without installing anything on the block: for hosts that call
    blocks themselves and keep their modules shared (ComfyUI's block replacements, one per patched model clone).
    The block goes through its captured graph; what cannot stream runs the block's stock forward, reported."""

    def __init__(self, module: nn.Module, budget: int | str | None = "auto", chunk_tokens: int | None = None, *,
                 reserve: int | str = DEFAULT_RESERVE, self_check: bool = False, kv: str = "device", name: str = ""):
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        from .recognize.generic import recognize_generic
        options = StreamOptions(budget, chunk_tokens, reserve=reserve, self_check=self_check, kv=kv)
        spec = recognize_generic(name, module)
        self.handle = StreamHandle(module, options, [spec] if isinstance(spec, Skip) else [])
        self.entry = None
        if not isinstance(spec, Skip):
            self.entry = Installed(name, module, spec, module.forward, _MISSING)
            self.handle.installed[name] = self.entry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.entry is None or BYPASS.active or self.entry.module.training:
            return self.handle.root(*args, **kwargs)
        with outermost(args, kwargs):
            return self.handle._run(self.entry, args, kwargs)

    def report(self) -> str:
        return self.handle.report()


def apply(module: nn.Module, budget: int | str | None = "auto", chunk_tokens: int | None = None, *,
          ffn_slice: int | None = None, head_groups: int | None = None, reserve: int | str = DEFAULT_RESERVE,
          self_check: bool = False, capture: str = "fallback", kv: str = "device",
          row_pieces: int | None = None, q_span: int | None = None, fuse: bool | None = None,
          hidden: str = "auto", replay: bool | None = None, kv_block: int | None = None,
          options: StreamOptions | None = None) -> "StreamHandle | PipelineHandle":
    """Stream every recognised structure inside ``module`` in place; returns a handle to report and undo.

    ``module`` may be a diffusers pipeline: each of its denoisers (``transformer``, Wan 2.2 A14B's ``transformer_2``,
    a ``unet``) is streamed under the same options, and one ``PipelineHandle`` reports and undoes them all.

    The keywords are ``StreamOptions``' fields (its docstring says what each does); ``options`` passes them as one
    object instead, and then no other keyword may be given. Nothing is installed until every argument is checked,
    and a failure while installing puts back every forward already replaced.
    """
    parts = None if isinstance(module, nn.Module) else pipeline_parts(module)
    if not isinstance(module, nn.Module) and parts is None:
        raise ValueError(f"module must be a torch.nn.Module or a diffusers pipeline, got {type(module).__name__}")
    if options is None:
        options = StreamOptions(budget, chunk_tokens, ffn_slice, head_groups, reserve, self_check, capture, kv,
                                row_pieces, q_span, fuse, hidden=hidden, replay=replay, kv_block=kv_block)
    else:
        given = _keywords_besides_options(locals())
        if given:
            raise ValueError(f"give apply either options=StreamOptions(...) or keywords, not both (also given: "
                             f"{', '.join(given)})")
        if not isinstance(options, StreamOptions):
            raise ValueError(f"options must be a streamplan.StreamOptions, got {type(options).__name__}")
        options = dataclasses.replace(options)   # checked again: its fields may have been set since it was made
    if parts is not None:
        return _apply_pipeline(module, parts, options)
    return _apply_module(module, options)


def _apply_module(module: nn.Module, options: StreamOptions) -> StreamHandle:
    capture = options.capture
    superseded = _supersede(module)
    specs, skipped = recognize(module, capture)
    for name, spec in list(specs.items()):
        if isinstance(spec, AttentionSpec) and consumer_for(spec.backend()) is None:
            del specs[name]
            skipped.append(Skip(name, type(spec.module).__name__,
                                f"attention backend {spec.backend()!r} registered no streamplan consumer"))
    handle = StreamHandle(module, options, skipped)
    try:
        for name, spec in specs.items():
            handle._install(name, spec)
        covered = [n for n, sp in specs.items() if n or not isinstance(sp, ModelSpec)]
        covered += [s.name for s in skipped if s.name]
        for name, stock in watch_candidates(module, covered) if specs else ():   # nothing streamed: untouched
            handle._watch(name, stock)
        if (specs or handle.watched) and "" not in specs:
            handle._track_root()
    except BaseException:
        handle.remove()
        raise
    _LIVE[module] = handle
    for other in superseded:
        other.superseded_by = handle
        log.info("streamplan: %r superseded by the new apply on %s", other, type(module).__name__)
    log.info("streamplan: %d module(s) streamed, %d left stock", len(handle.installed), len(skipped))
    return handle


def _apply_pipeline(pipe: Any, parts: list[tuple[str, nn.Module]], options: StreamOptions) -> "PipelineHandle":
    if not parts:
        raise ValueError(f"{type(pipe).__name__} has no denoiser component (transformer, transformer_2, unet) to "
                         "stream; pass the module itself, e.g. streamplan.apply(pipe.text_encoder)")
    handles: dict[str, StreamHandle] = {}
    try:
        for name, module in parts:
            handles[name] = _apply_module(module, dataclasses.replace(options))
    except BaseException:   # the pipeline left as it was
        for handle in handles.values():
            handle.remove()
        raise
    return PipelineHandle(pipe, handles)


class PipelineHandle:
    """One ``apply`` over a pipeline's denoisers: each has its own ``StreamHandle`` (``handle["transformer_2"]``),
    planned for its own calls (a budget holds each denoiser's call; a pipeline calls them one at a time)."""

    def __init__(self, pipe: Any, handles: dict[str, StreamHandle]):
        self.pipeline_class = type(pipe).__name__
        self.handles = handles

    def __getitem__(self, component: str) -> StreamHandle:
        return self.handles[component]

    @property
    def plans(self) -> dict[str, list[Plan]]:
        """Every component's plans, named from the pipeline (``transformer_2.blocks.0``; the model itself by its
        component name)."""
        return {f"{part}.{name}" if name else part: plans
                for part, h in self.handles.items() for name, plans in h.plans.items()}

    @property
    def removed(self) -> bool:
        return all(h.removed for h in self.handles.values())

    def remove(self) -> None:
        """Every denoiser's stock forwards back."""
        for handle in self.handles.values():
            handle.remove()

    def predicted_peak(self) -> int:
        return max((h.predicted_peak() for h in self.handles.values()), default=0)

    def to_json(self) -> str:
        return json.dumps({"pipeline": self.pipeline_class,
                           "components": {part: json.loads(h.to_json()) for part, h in self.handles.items()}},
                          indent=2)

    def timeline(self, path: str | None = None, *, title: str = "") -> list:
        """Each denoiser's memory picture of its last call (``StreamHandle.timeline``), written to ``path`` as one
        HTML file, a section each, one scale."""
        from . import timeline as _timeline
        found = [h.timeline(title=f"{title or self.pipeline_class}: {part}, its last call")
                 for part, h in self.handles.items()]
        if path is not None:
            _timeline.write_html(found, path)
        return found

    def report(self) -> str:
        parts = ", ".join(self.handles)
        return "\n\n".join([f"streamplan report for {self.pipeline_class}: its denoisers {parts}, each its own"]
                            + [f"[{part}] {h.report()}" for part, h in self.handles.items()])

    def __repr__(self) -> str:  # noqa: D105
        return f"<PipelineHandle {self.pipeline_class}: {', '.join(self.handles)}>"
