"""Per-thread facts about the call in progress: the outermost streamed call's baseline (what a byte budget is measured
from) and the bypass that makes every streamed module run stock (``verify``, ``self_check``, a capture)."""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from torch._subclasses.fake_tensor import is_fake

from ..registries import state_tensors


class _Root(threading.local):
    depth = 0
    base = 0      # CUDA bytes allocated when the outermost streamed or tracked call began
    inputs = 0    # bytes of that call's inputs
    calls = 0     # outermost calls begun so far (a handle's ledger of its last call starts anew at each)


ROOT = _Root()


@contextlib.contextmanager
def outermost(args: tuple, kwargs: dict):
    if ROOT.depth == 0:
        ROOT.calls += 1
        ROOT.inputs = live_bytes(args, kwargs)
        ROOT.base = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    ROOT.depth += 1
    try:
        yield
    finally:
        ROOT.depth -= 1


class _Rehearsal(threading.local):
    ledger = None    # while a model forward is rehearsed on fake tensors: the Ledger counting its device bytes
    budget = None    # a byte budget the rehearsal plans under in place of the options' (the smallest's search)
    least = False    # every operation planned at the smallest peak it reaches (the smallest budget's rehearsal)
    ahead = False    # the real run of a forward planned ahead: its parts' budget checks were the rehearsal's
    replays = None   # in a rehearsal: what each block's call did, by its call's key, for its twins (``replay``)
    structures = None   # in a rehearsal: each block's structure, by id, computed once
    replaying = False   # a block's call whose effect is being kept is in progress (calls inside it run as they are)


REHEARSAL = _Rehearsal()


def rehearsing() -> bool:
    """Whether this call runs in a rehearsal (fake tensors: shapes only, nothing computed, nothing allocated)."""
    return REHEARSAL.ledger is not None


def rehearsed(bounds: list) -> list:
    """A loop's bounds, in a rehearsal only the first two and the last: the ones between repeat the second's shapes
    (fake tensors hold no values, so skipping them changes no result, and the peak is the same)."""
    return bounds[:2] + bounds[-1:] if REHEARSAL.ledger is not None and len(bounds) > 3 else bounds


@contextlib.contextmanager
def rehearsal_settings(budget: int | None = None, least: bool = False):
    previous = REHEARSAL.budget, REHEARSAL.least
    REHEARSAL.budget, REHEARSAL.least = budget, least
    try:
        yield
    finally:
        REHEARSAL.budget, REHEARSAL.least = previous


@contextlib.contextmanager
def _set(holder: object, attr: str, value: object):
    """``holder.attr`` is ``value`` within the context, as it was after."""
    previous = getattr(holder, attr)
    setattr(holder, attr, value)
    try:
        yield
    finally:
        setattr(holder, attr, previous)


def planned_ahead():
    """The real run of a forward planned ahead: its parts' budget checks were the rehearsal's."""
    return _set(REHEARSAL, "ahead", True)


class _Where(threading.local):
    def __init__(self):
        self.names: list[str] = []


WHERE = _Where()   # the streamed modules whose calls are in progress, outermost first (a rehearsal's peak names them)


@contextlib.contextmanager
def within(name: str):
    WHERE.names.append(name)
    try:
        yield
    finally:
        WHERE.names.pop()


class _Bypass(threading.local):
    active = False


BYPASS = _Bypass()


def bypass():
    """Within this context every streamed module runs its stock forward (``verify`` and ``self_check`` use it)."""
    return _set(BYPASS, "active", True)


def needs_grad(module: nn.Module, x: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters())


def shapes(args: tuple, kwargs: dict) -> tuple:
    """The shape signature plans are cached by (tensors only, nested one level for tuples)."""
    def sig(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        if isinstance(v, (tuple, list)):
            return tuple(sig(x) for x in v)
        return None
    return tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))


def live_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the distinct tensors a call receives (its caller keeps them alive while it runs), a cache's
    tensors included."""
    seen: dict[int, int] = {}

    def visit(v, depth=0):
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta" or is_fake(v):   # no storage to share: each counts for its own size
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
        else:
            for t in state_tensors(v) or ():   # a cache
                visit(t, 2)

    for v in list(args) + list(kwargs.values()):
        visit(v)
    return sum(seen.values())
