"""``apply`` and the reversible ``StreamHandle`` (in the manner of accelerate's hooks)."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import weakref
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves as pytree_leaves

from . import hooks
from .budget import DEFAULT_RESERVE, auto_budget, parse_budget
from .consumers import consumer_for, graph_consumer, unsupported
from .executors.attention import run_attention
from .executors.donation import donated
from .executors.chunks import drain_retries
from .executors.mlp import run_mlp, run_seq_chunked
from .ir import (AttentionCall, AttentionSpec, GraphSpec, MLPSpec, ModelSpec, RowLocalSpec, Skip, adapt_call,
                 block_backend)
from .budget import fmt_bytes
from .planner import (DEFAULT_CHUNK_TOKENS, UTILISATION_FLOOR, AttentionDims, BudgetError, Plan,
                      plan_attention, plan_graph, plan_mlp, plan_rows, wave_quantum, Tier)
from .verify import compare_outputs, private_copy
from .stock_watch import StockWatch, activation_bytes, matters, watch_candidates
from .recognize import CAPTURE_MODES, recognize
from .recognize.checks import STREAMED_MARK, hooks_added_inside

log = logging.getLogger("streamplan")

_MISSING = object()
_STOCK_WHY = "runs stock (streamplan streams no structure here)"
PLAN_MARGIN = 0.03   # plans aim this far under the budget: allocator rounding and what the memory model misses


@dataclass
class StreamOptions:
    budget: int | str | None = None   # bytes, or "auto" (free device memory at planning time less ``reserve``)
    reserve: int = DEFAULT_RESERVE
    chunk_tokens: int | None = None
    ffn_slice: int | None = None
    self_check: bool = False
    head_groups: int | None = None


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


_INT_MEANING = {"chunk_tokens": "rows per chunk", "ffn_slice": "MLP hidden features per slice",
                "head_groups": "groups the K/V heads are split into"}


def _positive_int(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int ({_INT_MEANING[arg]}) or None, got {value!r}")
    return value


def _shapes(args: tuple, kwargs: dict) -> tuple:
    """The shape signature plans are cached by (tensors only, nested one level for tuples)."""
    def sig(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        if isinstance(v, (tuple, list)):
            return tuple(sig(x) for x in v)
        return None
    return tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))


def _wave_quantum(device: torch.device, call: AttentionCall) -> int:
    """Rows per whole wave of attention blocks on this GPU (1 elsewhere: no waves to fill)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return wave_quantum(sms, call.batch * call.heads)


def _describe_sig(sig: tuple) -> str:
    shapes = sig[0]
    if shapes and isinstance(shapes[0], int):
        text = str(list(shapes))
    else:
        text = ", ".join(str(s if not isinstance(s, tuple) or not s or not isinstance(s[0], str) else f"{s[0]}={s[1]}")
                         for s in shapes if s is not None and (not isinstance(s, tuple) or s[-1] is not None))
    return f"{text} {str(sig[1]).replace('torch.', '')}"


def _live_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the distinct tensors a call receives (its caller keeps them alive while it runs), a cache's
    tensors included."""
    seen: dict[int, int] = {}

    def visit(v, depth=0):
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta":   # no storage to share: each tensor counts for its own size
                seen[id(v)] = v.numel() * v.element_size()
                return
            try:
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # other storage-less tensors
                seen[id(v)] = v.numel() * v.element_size()
        elif depth < 2 and isinstance(v, (tuple, list)):
            for x in v:
                visit(x, depth + 1)
        elif depth < 2 and isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif hasattr(v, "layers") and hasattr(v, "get_seq_length"):  # a transformers cache
            for layer in getattr(v, "layers", []):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    visit(t, 2)

    for v in list(args) + list(kwargs.values()):
        visit(v)
    return sum(seen.values())


def _attention_dims(spec: AttentionSpec, call: AttentionCall, consumer) -> AttentionDims:
    kv_rows = call.rows
    if call.kv_whole is not None:
        kv_rows = 0  # short cross-attention K/V: built whole, small; counted in the chunk transient
    elem = torch.empty((), dtype=call.dtype).element_size()
    return AttentionDims(call.batch, call.rows, kv_rows, call.heads, call.kv_heads, call.head_dim, spec.dim_out,
                         elem, _mask_row_bytes(call) + _workspace_row_bytes(consumer, call, elem))


def _mask_row_bytes(call: AttentionCall) -> int:
    """Bytes per query row of a mask the binder prepares chunk by chunk (a broadcast mask costs nothing per row)."""
    m = call.mask
    if call.mask_rows is not None and m is not None and m.shape[-2] != 1:
        return m.numel() // m.shape[-2] * m.element_size()
    return 0


def _workspace_row_bytes(consumer, call: AttentionCall, elem: int) -> int:
    """What the consumer itself allocates per query row of a chunk, as it declares (0 if it declares nothing)."""
    declare = getattr(consumer, "workspace_row_bytes", None)
    if declare is None:
        return 0
    return declare(heads=call.heads, head_dim=call.head_dim, elem=elem, causal=call.causal,
                   masked=call.mask is not None)


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


class _Root(threading.local):
    depth = 0
    base = 0      # CUDA bytes allocated when the outermost streamed or tracked call began
    inputs = 0    # bytes of that call's inputs


_ROOT = _Root()

# every handle still in force, by its root: a later ``apply`` over the same modules supersedes it
_LIVE: "weakref.WeakKeyDictionary[nn.Module, StreamHandle]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _outermost(args: tuple, kwargs: dict):
    if _ROOT.depth == 0:
        _ROOT.inputs = _live_bytes(args, kwargs)
        _ROOT.base = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    _ROOT.depth += 1
    try:
        yield
    finally:
        _ROOT.depth -= 1


class _Bypass(threading.local):
    active = False


_BYPASS = _Bypass()


@contextlib.contextmanager
def bypass():
    """Within this context every streamed module runs its stock forward (``verify`` and ``self_check`` use it)."""
    previous, _BYPASS.active = _BYPASS.active, True
    try:
        yield
    finally:
        _BYPASS.active = previous


def _needs_grad(module: nn.Module, x: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters())


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
            if _BYPASS.active:
                return entry.stock(*args, **kwargs)
            if torch.compiler.is_compiling():   # inside a compiled module (its parts): dynamo would trace the chunks
                self._note(entry, "called under torch.compile: ran stock")
                return entry.stock(*args, **kwargs)
            if entry.module.training:   # checked per call: train() after apply must get the stock behaviour back
                self._note(entry, "in training mode: ran stock (streamplan is for inference: call .eval())")
                return entry.stock(*args, **kwargs)
            with _outermost(args, kwargs):
                return self._run(entry, args, kwargs)

        setattr(streamed_forward, STREAMED_MARK, True)
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
            if estimate is not None and not _BYPASS.active:
                x = args[0] if args else next(iter(kwargs.values()))
                available, live = self._available(args, kwargs, x.device)
                watch.record(estimate, live, tuple(x.shape))
                if isinstance(self.options.budget, int) and estimate > max(0, available):
                    raise BudgetError(
                        f"{name} ({type(module).__name__}) runs stock (streamplan does not stream it) and its output "
                        f"alone is {fmt_bytes(estimate)} for input {list(x.shape)}, more than the budget "
                        f"{fmt_bytes(self.options.budget)} leaves beside its live inputs ({fmt_bytes(live)}). Raise "
                        "the budget, shorten the sequence or lower the batch; for a causal LM ask for fewer logits "
                        "(logits_to_keep=1, as generate does).")
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
            with _outermost(args, kwargs):
                return stock(*args, **kwargs)

        module.forward = tracked_forward
        self._root_previous = previous
        self._root_wrapper = tracked_forward

    def _run(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        checking = self.options.self_check and not self.self_checked and not isinstance(entry.spec, ModelSpec)
        if checking:  # the reference runs stock on private copies: the caller's inputs and caches stay as they are
            ref_args, ref_kwargs = private_copy(args), private_copy(kwargs)
            with bypass():
                ref = entry.stock(*ref_args, **ref_kwargs)
            del ref_args, ref_kwargs
        out = _HANDLERS[type(entry.spec)](self, entry, args, kwargs)
        for a, b in drain_retries():
            self._note(entry, f"out of memory on rows [{a}:{b}): retried in halves")
        if checking and any(p.tier != Tier.L0 for p in entry.plans.values()):
            self._self_check(entry, out, ref)
        return out

    def _run_model(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        spec: ModelSpec = entry.spec
        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        why = spec.can_stream(args, kwargs)
        if why is None and tensors and _needs_grad(entry.module, tensors[0]):
            why = "autograd is recording"
        if why:
            self._note(entry, f"model forward ran stock: {why}")
            return entry.stock(*args, **kwargs)
        first = not entry.plans
        before = {id(p) for ps in self.plans.values() for p in ps}
        fixed = self.options.chunk_tokens or (DEFAULT_CHUNK_TOKENS if self.options.budget is None else None)
        plan = self._plan(entry, (_shapes(args, kwargs), tensors[0].dtype if tensors else None, "model"),
                          lambda _: Plan(Tier.L1, 0, fixed or 0, 0, 0, 0, note="model forward: block inputs donated, "
                                         "its own row loops (input projections, output head) in "
                                         + (f"{fixed}-row chunks" if fixed else "its blocks' smallest chunk")),
                          args, kwargs, tensors[0].device)
        if plan.tier == Tier.L0:   # every block fitted stock at the first call: the stock forward, as stock
            return entry.stock(*args, **kwargs)

        def chunk() -> int:
            """The model's own row loops: the given chunk, or under a budget its blocks' smallest planned chunk."""
            if fixed:
                return fixed
            planned = [p.chunk for e in self.installed.values() if e is not entry for p in e.plans.values()
                       if p.tier != Tier.L0]
            return min(planned, default=DEFAULT_CHUNK_TOKENS)

        out = spec.run(args, kwargs, chunk)
        if first:   # the model's figures are its largest block's, planned during this first call
            inner = [p for ps in self.plans.values() for p in ps if id(p) not in before and p is not plan]
            if inner:
                worst = max(inner, key=lambda p: p.predicted_total)
                plan.rows, plan.predicted_peak = worst.rows, worst.predicted_total - plan.live_bytes
                plan.stock_peak = max(p.live_bytes + p.stock_peak for p in inner) - plan.live_bytes
                plan.predicted_peak, plan.stock_peak = max(0, plan.predicted_peak), max(0, plan.stock_peak)
                if all(p.tier == Tier.L0 for p in inner):
                    plan.tier, plan.note = Tier.L0, "model forward: every block fits stock here: the stock forward"
        return out

    def _self_check(self, entry: Installed, out: Any, ref: Any) -> None:
        """Once per handle: the first streamed call is also run stock, and the difference is logged and kept."""
        self.self_checked = True
        diffs = compare_outputs(out, ref)
        worst = max((d["rel"] for d in diffs.values()), default=0.0)
        note = f"self-check against stock on the first call: max relative difference {worst:.2e}"
        self._note(entry, note)
        (log.warning if worst > 1e-2 else log.info)("streamplan: %s: %s", entry.name, note)

    def _attention_ready(self, entry: Installed, attn: AttentionSpec, args: tuple, kwargs: dict):
        """The consumer for this call, or None after noting why the call runs stock."""
        consumer = consumer_for(attn.backend())
        if consumer is None:
            self._note(entry, f"attention backend {attn.backend()!r} has no streamplan consumer: ran stock")
            return None
        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        if tensors and _needs_grad(entry.module, tensors[0]):
            self._note(entry, "autograd is recording: ran stock (streamed executors are for inference)")
            return None
        return consumer

    def _unsupported(self, entry: Installed, consumer, call: AttentionCall) -> bool:
        why = unsupported(consumer, heads=call.heads, kv_heads=call.kv_heads, head_dim=call.head_dim,
                          causal=call.causal, mask=call.mask, dtype=call.dtype)
        if why:
            self._note(entry, f"ran stock: {why}")
        return bool(why)

    def _bind(self, entry: Installed, attn: AttentionSpec, args: tuple, kwargs: dict):
        """(consumer, the call taken apart) when this call can stream, else None after noting why it runs stock."""
        consumer = self._attention_ready(entry, attn, args, kwargs)
        if consumer is None:
            return None
        call = entry.spec.bind(args, kwargs)
        if isinstance(call, str):
            self._note(entry, f"ran stock: {call}")
            return None
        if self._unsupported(entry, consumer, call):
            return None
        return consumer, call

    def _available(self, args: tuple, kwargs: dict, device: torch.device | None) -> tuple[int | None, int]:
        """(bytes this call may use, bytes alive around it). A byte budget covers the model's inputs and what the
        model allocated before this call (on CUDA, read from the allocator since the outermost call began; on CPU,
        which has no such counter, the call's own inputs); "auto" is what the device has free now."""
        live = _live_bytes(args, kwargs)
        if device is not None and device.type == "cuda" and _ROOT.depth:
            live = max(live, torch.cuda.memory_allocated(device) - _ROOT.base + _ROOT.inputs)
        budget = self.options.budget
        if budget is None:
            return None, live
        if budget == "auto":
            return int(auto_budget(device, self.options.reserve) * (1 - PLAN_MARGIN)), live
        return int((budget - live) * (1 - PLAN_MARGIN)), live

    def _plan(self, entry: Installed, sig: tuple, make: Callable[[int | None], Plan], args: tuple = (),
              kwargs: dict | None = None, device: torch.device | None = None) -> Plan:
        plan = entry.plans.get(sig)
        if plan is None:
            available, live = self._available(args, kwargs or {}, device)
            if available is not None and available <= 0:
                raise BudgetError(f"{entry.name or type(entry.module).__name__}: the budget "
                                  f"{fmt_bytes(self.options.budget)} is already taken by the call's inputs "
                                  f"({fmt_bytes(live)}); nothing is left for its work")
            try:
                plan = make(available)
            except BudgetError as exc:
                raise BudgetError(f"{entry.name or type(entry.module).__name__}: budget "
                                  f"{fmt_bytes(self.options.budget) if self.options.budget != 'auto' else 'auto'} "
                                  f"less its live inputs ({fmt_bytes(live)}) cannot hold it. {exc}. Raise the "
                                  "budget, shorten the sequence, or lower the batch.") from None
            plan.live_bytes, plan.budget = live, available
            entry.plans[sig] = plan
            log.info("streamplan: %s planned for %s: %s", entry.name or type(entry.module).__name__, sig[0],
                     plan.describe())
        return plan

    def _run_row_local(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or _needs_grad(entry.module, x):
            return entry.stock(*args, **kwargs)
        o = self.options
        row_bytes = x.numel() // x.shape[1] * x.element_size()
        plan = self._plan(entry, (_shapes(args, kwargs), x.dtype, x.device.type), lambda budget: plan_rows(
            x.shape[1], row_bytes, entry.spec.transient_per_elem, chunk_tokens=o.chunk_tokens, budget=budget),
            args, kwargs, x.device)
        if plan.tier == Tier.L0:
            return entry.stock(*args, **kwargs)
        return run_seq_chunked(entry.stock, x, plan.chunk, args[1:], kwargs)

    def _run_mlp(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return entry.stock(*args, **kwargs)
        x = args[0]
        if _needs_grad(entry.module, x):
            self._note(entry, "autograd is recording: ran stock (streamed executors are for inference)")
            return entry.stock(x)
        o = self.options
        rows = x.numel() // x.shape[-1]
        plan = self._plan(entry, (tuple(x.shape), x.dtype, x.device.type), lambda budget: plan_mlp(
            entry.spec, rows, x.element_size(), chunk_tokens=o.chunk_tokens, ffn_slice=o.ffn_slice, budget=budget),
            args, kwargs, x.device)
        if plan.tier == Tier.L0:
            return entry.stock(x)
        return run_mlp(entry.spec, plan, entry.stock, x)

    def _run_attention(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        spec: AttentionSpec = entry.spec
        bound = self._bind(entry, spec, args, kwargs)
        if bound is None:
            return entry.stock(*args, **kwargs)
        consumer, call = bound
        o = self.options
        device = call.segments[0].source.device
        sig = (_shapes(args, kwargs), call.dtype, device.type)
        plan = self._plan(entry, sig, lambda budget: plan_attention(
            _attention_dims(spec, call, consumer), chunk_tokens=o.chunk_tokens, budget=budget,
            q_align=consumer.caps.q_align,
            head_groups=o.head_groups, can_group=call.cache_update is None and call.kv_whole is None,
            min_chunk=UTILISATION_FLOOR.get(device.type, 0)), args, kwargs, device)
        if plan.tier == Tier.L0:
            return entry.stock(*args, **kwargs)
        return run_attention(call, consumer, plan.chunk, plan.head_groups)

    def _run_graph(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        """A block streamed from its captured graph (``streamplan.capture``). The graph reads the block's weights
        directly: hooks on leaves inside it (leaf-level offloading, layerwise casting) put them in place first."""
        if not hooks.leaf_hooks(entry.module):
            return self._run_graph_onloaded(entry, args, kwargs)
        with hooks.onloaded(entry.module):
            return self._run_graph_onloaded(entry, args, kwargs)

    def _run_graph_onloaded(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        from .capture import rows_of_call, streamable
        from .capture.execute import GraphRun
        from .capture.memory import _numel as numel_besides, graph_memory

        module = entry.module
        stock = functools.partial(entry.stock, *args, **kwargs)
        adapted = adapt_call(module, args, kwargs)   # a cache object, say: the call as the graph takes it
        if isinstance(adapted, str):
            self._note(entry, f"ran stock: {adapted}")
            return stock()
        args, kwargs = (adapted.args, adapted.kwargs) if adapted is not None else (args, kwargs)
        tensors = [t for t in pytree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:
            return stock()
        if _needs_grad(module, tensors[0]):
            self._note(entry, "autograd is recording: ran stock (streamed executors are for inference)")
            return stock()
        rows = rows_of_call(args, kwargs)
        if rows is None or rows < 2:
            return stock()
        hooked = hooks_added_inside(module)
        if hooked:
            self._note(entry, f"ran stock: {hooked}")
            return stock()
        backend = block_backend(module)
        consumer = graph_consumer(backend)
        if consumer is None:
            self._note(entry, f"attention backend {backend!r} has no streamplan consumer: ran stock")
            return stock()
        with bypass():   # the capture traces the stock forwards of any streamed children
            found, fresh = streamable(module, args, kwargs, rows)
        if isinstance(found, str):
            self._note(entry, f"ran stock: {found}")
            return stock()
        an, cap = found.analysis, found.captured
        if fresh or not any(n.startswith("captured") for n in entry.runtime_notes):
            static = f"; {found.static_rows} static rows joined (computed once per phase)" if found.static_rows else ""
            self._note(entry, f"captured in {cap.seconds:.2f} s: {an.ops} ops, {len(an.attentions)} global "
                       f"attention(s){static}")
        att = an.attentions[0] if an.attentions else None   # none: every op row-local (cross-attention, an MLP)
        if att is not None:
            qv, kv_ = att.q.meta["val"], att.k.meta["val"]
            why = unsupported(consumer, heads=qv.shape[1], kv_heads=kv_.shape[1], head_dim=qv.shape[-1],
                              causal=att.causal, mask=None, dtype=qv.dtype)
            if why:
                self._note(entry, f"ran stock: {why}")
                return stock()
        o = self.options
        regions = found.mlp_regions
        groups = _graph_head_groups(found) if adapted is None else ()   # L3 keeps no whole K/V to hand back
        if adapted is not None and (len(an.attentions) != 1 or an.attentions[0].k.meta["val"].shape[1]
                                    != adapted.kv_heads):
            self._note(entry, "ran stock: the graph's K/V are not the ones its cache would hold")
            return stock()
        if o.head_groups and o.head_groups not in groups:
            self._note(entry, f"head_groups={o.head_groups} (L3) not used: the graph allows "
                       f"{list(groups) or 'none (one global attention without static rows or input writes is needed)'}")
        if o.ffn_slice and not regions:
            self._note(entry, "ffn_slice: no linear -> elementwise -> linear MLP found in the graph to slice")
        donate = {}
        out0 = an.outputs[0] if an.outputs else None
        r0 = an.rows.get(out0) if out0 is not None else None
        if getattr(r0, "dim", None) == 1 and r0.pre + r0.post == 0:   # the output has the input's rows: donate
            x = next((t for t in tensors if donated(t)), None)
            held = hooks.holding_inputs(module) if x is not None else None
            if held:   # a cache hook compares the block's output with its input: that input must survive
                self._note(entry, f"block input not donated: {held} keeps a reference to it")
                x = None
            val = out0.meta["val"]
            if x is not None and x.dim() == val.dim() and x.shape[1] == rows and x.dtype == val.dtype:
                donate[0] = x
        device = tensors[0].device
        sig = (_shapes(args, kwargs), tensors[0].dtype, device.type, bool(donate))

        def make_plan(budget: int | None) -> Plan:
            mem = graph_memory(an, found.phases, rows, set(donate))
            order = [n for n in cap.graph.nodes if n.op == "call_function" and n not in an.ignored]
            quantum, ws, attn_out = 1, 0, 0
            if att is not None:
                if device.type == "cuda":
                    quantum = wave_quantum(torch.cuda.get_device_properties(device).multi_processor_count,
                                           qv.shape[0] * qv.shape[1])
                ws = _workspace_row_bytes(consumer, SimpleNamespace(heads=qv.shape[1], head_dim=qv.shape[-1],
                                                                    causal=att.causal, mask=None), qv.element_size())
                out_val = att.node.meta["val"]
                attn_out = numel_besides(out_val, 2) * rows * out_val.element_size() if groups else 0
            return plan_graph(rows, mem.kv_bytes + mem.out_bytes,
                              lambda c, sl: mem.transient(c, sl, regions) + ws * min(c, rows), mem.stock(order),
                              chunk_tokens=o.chunk_tokens, budget=budget,
                              min_chunk=UTILISATION_FLOOR.get(device.type, 0), quantum=quantum,
                              ffn=max((r.ffn for r in regions), default=0), ffn_slice=o.ffn_slice,
                              kv=mem.kv_bytes, attn_out=attn_out, groups=groups, head_groups=o.head_groups)

        plan = self._plan(entry, sig, make_plan, args, kwargs, device)
        if plan.tier == Tier.L0:
            return stock()

        def attend(q, k, v, *, q_offset, causal, scale):
            return consumer.attend(q, k, v, q_offset=q_offset, causal=causal, mask=None, scale=scale)

        run = GraphRun(cap, an, found.phases, module, args, kwargs, rows, attend,
                       ffn_slice=plan.ffn_slice if plan.tier in (Tier.L2, Tier.L3) else 0, regions=regions)
        if plan.tier == Tier.L3:
            run.build_grouped(plan.chunk, plan.head_groups)
        else:
            run.build_kv(plan.chunk)
        kv = run.kv[att.node] if adapted is not None else None   # phase Q lets go of its buffers: keep them
        out = run.run_q(plan.chunk, donate)
        if kv is not None:
            adapted.fill(*kv)
        return out

    @staticmethod
    def _note(entry: Installed, note: str) -> None:
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

    def _stock_that_matters(self) -> list[StockWatch]:
        largest = max((p.predicted_peak for plans in self.plans.values() for p in plans), default=0)
        return [w for w in self.watched.values() if matters(w, largest)]

    def to_json(self) -> str:
        return json.dumps({
            "streamed": {n: {"class": type(e.module).__name__, "recognized_as": e.spec.label,
                             "plans": [{"shape": repr(s[0]), "dtype": str(s[1]), **p.to_dict()}
                                       for s, p in e.plans.items()]}
                         for n, e in self.installed.items()},
            "stock": [{"name": s.name, "class": s.cls, "reason": s.reason} for s in self.skipped]
                     + [{"name": w.name, "class": type(w.module).__name__, "reason": _STOCK_WHY,
                         "input_shape": list(w.shape or ()), "output_bytes": w.largest, "live_bytes": w.live}
                        for w in self._stock_that_matters()],
        }, indent=2)

    def predicted_peak(self) -> int:
        """The largest predicted peak of any planned call or of a stock module's output seen so far, its live
        inputs included (what a budget covers)."""
        planned = (p.predicted_total for plans in self.plans.values() for p in plans)
        return max(max(planned, default=0), max((w.total for w in self.watched.values()), default=0))

    def report(self) -> str:
        """What was streamed and how (a table per input signature), and what was left stock and why."""
        root = type(self.root).__name__
        lines = [f"streamplan report for {root}"]
        if self.options.budget is not None:
            b = self.options.budget
            lines.append(f"  budget: {b if b == 'auto' else fmt_bytes(b)}"
                         + (f" (reserve {fmt_bytes(self.options.reserve)})" if b == "auto" else ""))
        if self.superseded_by is not None:
            lines.append("  superseded by a later streamplan.apply on these modules: that handle's report is current")
        elif self.removed:
            lines.append("  handle removed: the model runs its stock forwards")
        if not self.installed and not self.removed:
            lines.append(f"  nothing recognised in {root}: the model is untouched")
        nw = max([len(n or "<root>") for n in self.installed] + [6])
        lw = max([len(e.spec.label) for e in self.installed.values()] + [2])
        if self.installed:
            header = (f"  {'module':<{nw}} {'as':<{lw}} {'tier':<4} {'chunk':>6} {'ffn':>6} {'predicted':>11} "
                      f"{'stock est.':>11}")
            lines += [header, "  " + "-" * (len(header) - 2)]
        graphs = [n for n, e in self.installed.items() if isinstance(e.spec, GraphSpec)]
        for name, e in self.installed.items():
            label = e.spec.label
            if not e.plans and not e.runtime_notes and any(_inside(name, g) for g in graphs):
                continue   # a block's part, idle while its graph takes every call: the block's label says so
            if not e.plans:
                lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} (not called yet: planned at the first call)")
            for sig, plan in e.plans.items():
                if plan.note:
                    lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} {plan.tier:<4} {plan.note}")
                    continue
                ffn = str(plan.ffn_slice) if plan.tier == Tier.L2 else "-"
                chunk = str(plan.chunk) if plan.tier != Tier.L0 else "-"
                lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} {plan.tier:<4} {chunk:>6} {ffn:>6} "
                             f"{fmt_bytes(plan.predicted_total):>11} "
                             f"{fmt_bytes(plan.live_bytes + plan.stock_peak):>11}")
                lines.append(f"      input {_describe_sig(sig)}: {plan.describe()}")
            for note in e.runtime_notes:
                lines.append(f"      note: {note}")
        if self.installed:
            lines.append("  (predicted and stock est.: peak bytes with the call's live inputs, from the memory model;"
                         " measured stock may differ: benchmarks/ has measurements)")
        for s in self.skipped:
            lines.append(f"  stock     {s.name or '<root>'}  ({s.cls}): {s.reason}")
        for w in self._stock_that_matters():
            lines.append(f"  stock     {w.name}  ({type(w.module).__name__}): {_STOCK_WHY}; output "
                         f"{fmt_bytes(w.largest)} for input {list(w.shape or ())} (+{fmt_bytes(w.live)} live inputs)")
        return "\n".join(lines)

    def __repr__(self) -> str:  # noqa: D105
        return f"<StreamHandle {len(self.installed)} streamed, {len(self.skipped)} left stock>"


def _inside(name: str, parent: str) -> bool:
    return name != parent and (not parent or name.startswith(parent + "."))


def _graph_head_groups(found) -> tuple[int, ...]:
    """Head-group counts L3 can use on a captured block: one global attention, its rows without static ones, no
    writes into the block's inputs (each group reruns the projections), and groups dividing the K/V heads."""
    an = found.analysis
    if len(an.attentions) != 1 or an.input_writes or found.static_rows:
        return ()
    att = an.attentions[0]
    if att.q_rows is None or (att.q_rows.pre, att.q_rows.post) != (0, 0) or att.q_rows.dim != 2:
        return ()
    kv_heads, heads = att.k.meta["val"].shape[1], att.q.meta["val"].shape[1]
    if not isinstance(kv_heads, int) or not isinstance(heads, int):
        return ()
    return tuple(g for g in (2, 4, 8, 16, 32, 64) if g <= kv_heads and kv_heads % g == 0 and heads % g == 0)


_HANDLERS: dict[type, Callable[..., Any]] = {   # how each kind of spec runs; a new spec type registers here
    ModelSpec: StreamHandle._run_model, AttentionSpec: StreamHandle._run_attention,
    RowLocalSpec: StreamHandle._run_row_local, MLPSpec: StreamHandle._run_mlp, GraphSpec: StreamHandle._run_graph,
}


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


def _options(budget, chunk_tokens, ffn_slice, head_groups, reserve, self_check) -> StreamOptions:
    chunk_tokens = _positive_int(chunk_tokens, "chunk_tokens")
    ffn_slice = _positive_int(ffn_slice, "ffn_slice")
    head_groups = _positive_int(head_groups, "head_groups")
    reserve = parse_budget(reserve, None, arg="reserve", allow_zero=True)
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        parsed: int | str | None = "auto"   # resolved when each operation is planned, from what is free then
    else:
        parsed = parse_budget(budget, None)
    return StreamOptions(parsed, reserve, chunk_tokens, ffn_slice, bool(self_check), head_groups)


class BlockStreamer:
    """Streams the calls one caller makes to a block, without installing anything on the block: for hosts that call
    blocks themselves and keep their modules shared (ComfyUI's block replacements, one per patched model clone).
    The block goes through its captured graph; what cannot stream runs the block's stock forward, reported."""

    def __init__(self, module: nn.Module, budget: int | str | None = "auto", chunk_tokens: int | None = None, *,
                 reserve: int | str = DEFAULT_RESERVE, self_check: bool = False, name: str = ""):
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        from .recognize.generic import recognize_generic
        options = _options(budget, chunk_tokens, None, None, reserve, self_check)
        spec = recognize_generic(name, module)
        self.handle = StreamHandle(module, options, [spec] if isinstance(spec, Skip) else [])
        self.entry = None
        if not isinstance(spec, Skip):
            self.entry = Installed(name, module, spec, module.forward, _MISSING)
            self.handle.installed[name] = self.entry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.entry is None or _BYPASS.active or self.entry.module.training:
            return self.handle.root(*args, **kwargs)
        with _outermost(args, kwargs):
            return self.handle._run(self.entry, args, kwargs)

    def report(self) -> str:
        return self.handle.report()


def apply(module: nn.Module, budget: int | str | None = "auto", chunk_tokens: int | None = None, *,
          ffn_slice: int | None = None, head_groups: int | None = None, reserve: int | str = DEFAULT_RESERVE,
          self_check: bool = False, capture: str = "fallback") -> StreamHandle:
    """Stream every recognised structure inside ``module`` in place; returns a handle to report and undo.

    ``budget`` (bytes, ``"12GiB"``, or ``"auto"``: the device's free memory when an operation is first planned) lets
    the planner pick tiers and chunks, keeping stock wherever stock fits; ``budget=None`` streams every input longer
    than a fixed default chunk instead. ``chunk_tokens`` forces row streaming at that chunk; ``ffn_slice`` forces
    feature-sliced MLPs with that many hidden features per slice;
    ``head_groups`` forces head-grouped K/V (L3) with the K/V heads split into that many groups.
    ``reserve`` is kept free under ``budget="auto"``. ``self_check`` runs the first streamed call stock as well and
    logs (and reports) the difference. ``capture`` picks the way in for blocks: "fallback" (default) streams every
    block from its captured graph unless a part recognizer knows the block itself (an MLP in a list of experts),
    "prefer" captures every block, "off" captures nothing (hand-written parts and model forwards only).
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    options = _options(budget, chunk_tokens, ffn_slice, head_groups, reserve, self_check)
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {', '.join(CAPTURE_MODES)}; got {capture!r}")
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
