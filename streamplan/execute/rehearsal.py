"""A model forward rehearsed on fake tensors before it runs: every op runs for its shapes alone (nothing computed,
nothing allocated), the blocks plan exactly as they will in the real call, and a ledger counts the device bytes each
op's output would hold and when they would be freed. The rehearsal's peak is the forward's: its own whole-sequence
tensors (hidden state, rotary tables, per-row tables, the head's buffer) beside each block's work.

Small values stay real: an op that writes nothing, whose tensor inputs are all real and which reads and makes at most
``SMALL`` bytes, runs for real (ids, positions, padding masks, timesteps): decisions a forward takes on values (whether
a padding mask pads, whether positions are packed) are the real call's, not a tracer's conservative ones.

A chunk loop in a rehearsal runs its first two chunks and its last (``chunk_loop.chunk_bounds``): the chunks between
repeat the second's shapes, so the peak is the same and a 40-layer forward at 217k rows rehearses in seconds."""
from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedFakeTensorException)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

from ..plan.budget import fmt_bytes
from ..registries import state_tensors
from . import hook_chains as hooks
from .call_state import REHEARSAL, WHERE

log = logging.getLogger("streamplan")

SMALL = 1 << 16   # bytes up to which an op on real values runs for real in a rehearsal
FORWARD = "the model forward's own ops"   # where an allocation made outside every streamed module is charged


@dataclass
class Held:
    """One allocation alive at the rehearsal's peak: its bytes, the op that made it, and which call was running."""

    nbytes: int
    op: str
    where: str


@dataclass
class Rehearsed:
    """What a rehearsal found: the peak device bytes the forward adds, where it was then, and what was held."""

    peak: int
    where: str
    held: list[Held] = field(default_factory=list)   # the largest allocations alive at the peak, largest first
    host_peak: int = 0   # host memory held at once for rows kept off the device (L4's stores, L6's rows)

    def describe(self, top: int = 3) -> str:
        parts = [f"{fmt_bytes(h.nbytes)} from {h.op} in {h.where}" for h in self.held[:top]]
        return f"in {self.where}, holding " + "; ".join(parts) if parts else f"in {self.where}"


class RehearsalFailed(RuntimeError):
    """The forward could not run on fake tensors (an op that reads values, a module that keeps state)."""


class Ledger(TorchDispatchMode):
    """Counts the bytes of every fresh output storage on ``device`` while alive (a storage's finaliser frees it);
    views, in-place ops and outputs on other devices (host stores) add nothing."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self.live: dict[int, Held] = {}
        self.at_peak: Rehearsed = Rehearsed(0, FORWARD)
        self._snapped = 0
        self.window_peak = 0
        self.host_current = self.host_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._fused_sdp_choice.default:   # fake inputs would say math: ask with real stand-ins
            with _pop_mode_temporarily():
                return func(*pytree.tree_map(_stand_in, args), **pytree.tree_map(_stand_in, kwargs))
        real = _real_inputs(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if real is None:
                raise
            out = None   # a value read from real values (``.item()``): run for real
        if real is not None and (out is None or real + _nbytes(out) <= SMALL):
            with _pop_mode_temporarily() as fake:   # the fake mode (the ledger is off the stack while it dispatches)
                if not isinstance(fake, FakeTensorMode):
                    raise RuntimeError("streamplan: a dispatch mode entered inside a rehearsal")
                out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, o in zip(func._schema.returns, outs):
            if isinstance(o, torch.Tensor) and ret.alias_info is None and o.device == self.device:
                self._count(o, func)
        return out

    def _count(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        held = Held(storage.nbytes(), str(func.overloadpacket.__name__), WHERE.names[-1] if WHERE.names else FORWARD)
        self.live[key] = held
        weakref.finalize(storage, self._free, key)
        self.current += held.nbytes
        self.window_peak = max(self.window_peak, self.current)
        if self.current > self.peak:
            self._new_peak(self.current, held.where)

    def _new_peak(self, peak: int, where: str, extra: Held | None = None) -> None:
        self.peak = peak
        if self.peak > self._snapped * 1.01:   # a snapshot per percent of growth: the largest live, and where
            self._snapped = self.peak
            largest = sorted([*self.live.values(), *([extra] if extra else [])], key=lambda h: -h.nbytes)[:3]
            self.at_peak = Rehearsed(self.peak, where, largest)

    def window(self) -> tuple[int, int]:
        """Start measuring a call's own peak (``window_end``); returns what to hand back then."""
        started = (self.current, self.window_peak)
        self.window_peak = self.current
        return started

    def window_end(self, started: tuple[int, int]) -> int:
        """The call's peak above what was live when its window started."""
        at, outer = started
        peak, self.window_peak = self.window_peak - at, max(outer, self.window_peak)
        return peak

    def lift(self, above: int, where: str) -> None:
        """A replayed call's peak: ``above`` bytes over what is live now, for a moment (``replay``)."""
        self.window_peak = max(self.window_peak, self.current + above)
        if self.current + above > self.peak:
            self._new_peak(self.current + above, where, Held(above, "its work (replayed from its twin)", where))

    def count_host(self, t: torch.Tensor) -> None:
        """A host buffer (``host_rows.host_empty``): its bytes held as host memory while it lives."""
        n = t.untyped_storage().nbytes()
        self.host_current += n
        self.host_peak = max(self.host_peak, self.host_current)
        weakref.finalize(t.untyped_storage(), self._free_host, n)

    def _free_host(self, n: int) -> None:
        self.host_current -= n

    def _free(self, key: int) -> None:
        held = self.live.pop(key, None)
        if held is not None:
            self.current -= held.nbytes

    def result(self) -> Rehearsed:
        return Rehearsed(self.peak, self.at_peak.where, self.at_peak.held, self.host_peak)


def _stand_in(x: Any) -> Any:
    """A real tensor of ``x``'s shape, dtype and device over one row of memory (the kernels' checks read shapes,
    dtypes, devices and the last dimension's stride, not values)."""
    if not isinstance(x, FakeTensor):
        return x
    return torch.empty(x.shape[-1], dtype=x.dtype, device=x.device).as_strided(x.shape, (0,) * (x.dim() - 1) + (1,))


def _real_inputs(func, args: tuple, kwargs: dict) -> int | None:
    """The bytes of an op's tensor inputs when it writes nothing and they are all real and at most ``SMALL``."""
    if func._schema.is_mutable or func is torch.ops.aten.lift_fresh.default:   # lifted (``torch.tensor``): fake,
        return None                                                              # as stock's in-place ops on it need
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(isinstance(t, FakeTensor) for t in ins):
        return None
    n = _nbytes(ins)
    return n if n <= SMALL else None


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def ledger_paused():
    """Outside the ledger for a while (a capture's trace is not the forward's memory); a no-op outside rehearsals."""
    if REHEARSAL.ledger is None:
        yield
        return
    with _pop_mode_temporarily() as mode:   # in a rehearsal the ledger is the innermost mode
        if mode is not REHEARSAL.ledger:
            raise RuntimeError("streamplan: a dispatch mode entered inside a rehearsal")
        yield


def rehearsal_problem(args: tuple, kwargs: dict) -> str | None:
    """Why a call cannot be rehearsed (None: it can): a cache that already holds tensors would have to be copied, and
    an empty one is filled in a copy, which some caches refuse (an offloading cache holds a stream)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        tensors = state_tensors(leaf)
        if tensors and any(t.numel() for t in tensors):
            return f"its {type(leaf).__name__} already holds tensors"
        if tensors is not None:
            try:
                copy.deepcopy(leaf)
            except (TypeError, copy.Error, RuntimeError) as exc:
                return f"its {type(leaf).__name__} cannot be copied ({exc})"
    return None


def rehearse(run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict, device: torch.device,
             root: nn.Module) -> Rehearsed:
    """``run(args, kwargs)`` on fake copies of the call's tensors, with the ledger counting ``device``'s bytes.
    Whatever a module kept of the rehearsal (a fake tensor cached in an attribute) is put back as it was. Hooks that
    move weights are set aside, the weights they would bring stood in where they would be (the caller counts them)."""
    state = _module_tensors(root)
    ledger = Ledger(device)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args, fake_kwargs = _fake_copy((args, kwargs), mode)
        with mode, hooks.set_aside(root, _stand_in_weight):
            REHEARSAL.ledger, REHEARSAL.replays, REHEARSAL.structures = ledger, {}, {}
            with ledger:
                run(fake_args, fake_kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException) as exc:
        raise RehearsalFailed(f"an op reads values, not only shapes ({type(exc).__name__}: {exc})") from None
    finally:
        REHEARSAL.ledger, REHEARSAL.replays, REHEARSAL.structures = None, None, None
        _put_back(root, state)
    return ledger.result()


def _stand_in_weight(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fake of ``t`` where a hook would bring it (made in the fake mode, outside the ledger: the caller counts it)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)


def _fake_copy(tree: Any, mode: FakeTensorMode) -> Any:
    def fake(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.numel() * leaf.element_size() <= SMALL:
            return leaf.clone()   # a small value stays real (a private copy: the forward may write into it)
        if isinstance(leaf, torch.Tensor):
            return mode.from_tensor(leaf)
        if state_tensors(leaf) is not None:   # an empty cache: the rehearsal fills a copy
            return copy.deepcopy(leaf)
        return leaf
    return pytree.tree_map(fake, tree)


def _module_tensors(root: nn.Module) -> list[tuple[nn.Module, str, dict, Any]]:
    saved = []
    for m in root.modules():
        for where in (m._parameters, m._buffers, m.__dict__):
            for k, v in where.items():
                if isinstance(v, torch.Tensor):
                    saved.append((m, k, where, v))
    return saved


def _put_back(root: nn.Module, saved: list[tuple[nn.Module, str, dict, Any]]) -> None:
    before = {(id(where), k): v for _, k, where, v in saved}
    for m in root.modules():
        for where in (m._parameters, m._buffers, m.__dict__):
            for k, v in list(where.items()):
                if isinstance(v, FakeTensor):
                    old = before.get((id(where), k))
                    log.debug("streamplan: rehearsal: %s.%s kept a fake tensor: put back", type(m).__name__, k)
                    if old is None:
                        del where[k]
                    else:
                        where[k] = old


