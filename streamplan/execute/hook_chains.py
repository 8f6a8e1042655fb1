"""streamplan among other libraries' forward hooks, library-agnostic.

A hooking library (diffusers' ``HookRegistry``, accelerate's ``add_hook_to_module``) replaces ``module.forward`` with a
chain: each hook's ``pre_forward``, then the next hook in, down to the module's own forward, then each
``post_forward`` on the way out (a hook with ``new_forward``, such as a cache, calls the next link itself, or not).
streamplan puts its streamed forward in place of that innermost link, where the stock forward ran: an offload hook
onloads the weights before it, a cache hook decides whether it runs at all. Hooks registered later wrap outside it, as
they would wrap the stock forward; ``uninstall`` finds the link wherever the chain holds it by then.

Hooks on the leaves inside a captured block (leaf-level group offloading, layerwise casting, sequential CPU offload)
act when each leaf is called; the captured graph reads the leaves' weights directly, so ``onloaded`` runs those hooks'
``pre_forward`` for every leaf before the capture and the graph run and their ``post_forward`` after: the block's
weights are on the execution device (and in the compute dtype) for the whole streamed call.

This file knows no library. Each library's file under ``streamplan.integrations`` (``diffusers.hooks``, ``accelerate``)
registers how its chain is laid out (a ``Chain``: ``register_chain``) and what each of its hook classes does (a
``HookKind``: ``register_hook_kind``). A hook class nobody registered keeps the module stock, named; so does a
registered one whose kind says why (``HookKind.stock``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from ..specs import DESCRIBED_MARK, MODEL_MARK, STREAMED_MARK


@dataclass(frozen=True)
class Brought:
    """The weights one hook puts on the execution device for its module's call (group offloading's group, a casting
    hook's compute-dtype copies): counted once per ``key`` however many modules share it."""
    key: int
    tensors: list[torch.Tensor]      # the module tensors it brings (as they are held now: offloaded, on meta, stored)
    device: torch.device
    dtype: torch.dtype | None = None  # what they are brought in as, None: their own
    ahead: bool = False               # the library brings the next one in (on a side stream) while this one runs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * (t.element_size() if self.dtype is None else self.dtype.itemsize)
                   for t in self.tensors)


@dataclass(frozen=True)
class HookKind:
    """What a hook class does to a module's call, as far as streamplan needs to know."""
    around: bool = False        # may wrap a streamed module's own forward (moves weights or inputs, decides if it runs)
    weights: bool = False       # on a leaf inside a captured block: only puts the leaf's weights in place (device,
    #                             dtype), no effect on its inputs' values or its output: run around the graph
    lets_go: bool = False       # keeps no reference to the module's inputs past its forward (an input may be donated)
    keeps_output: bool = False  # keeps a reference to the module's output (whoever calls next must not overwrite it)
    stock: str | None = None    # known, but a module with it stays stock: why
    # moves weights or inputs only (no effect on values, never decides whether the module runs): a rehearsal sets it
    # aside, stands the weights it brings in on the device, and counts them (``brings``)
    rehearsed: bool = False
    brings: Callable[[Any, nn.Module], Brought | None] | None = None
    # puts back what the hook brought when the call it began ends in an error (a refusal raised inside the chain: the
    # hook's own after-call never runs)
    release: Callable[[Any, nn.Module], None] | None = None


class Chain(Protocol):
    """How one library lays out its hook chain on a module."""
    library: str        # "diffusers", "accelerate": the name in reports and the key of its hook kinds
    module_prefix: str  # a hook class counts as the library's only when its __module__ starts with this

    def present(self, module: nn.Module) -> bool:
        """Whether the module carries this library's hooks at all."""

    def hooks(self, module: nn.Module) -> list[tuple[str, Any]] | None:
        """(label, hook) outermost first, as a call meets them, when this library's chain is what ``module.forward``
        runs; None otherwise."""

    def inner(self, module: nn.Module) -> tuple[Any, str]:
        """(holder, attribute) of the innermost link: the reference that calls the module's own forward."""

    def links(self, module: nn.Module) -> Iterable[tuple[Any, str]]:
        """Every (holder, attribute) where a link of the chain may sit now (hooks added or removed move them)."""


_CHAINS: list[Chain] = []
_KINDS: dict[tuple[str, str], HookKind] = {}


def register_chain(chain: Chain) -> None:
    if all(c.library != chain.library for c in _CHAINS):
        _CHAINS.append(chain)


def register_hook_kind(library: str, class_name: str, kind: HookKind) -> None:
    _KINDS[(library, class_name)] = kind


def chain_of(module: nn.Module) -> tuple[Chain, list[tuple[str, Any]]] | None:
    """The library chain ``module.forward`` runs and its hooks, outermost first, or None."""
    for chain in _CHAINS:
        found = chain.hooks(module)
        if found is not None:
            return chain, found
    return None


def libraries_on(module: nn.Module) -> list[str]:
    """The libraries whose hooks the module carries."""
    return [c.library for c in _CHAINS if c.present(module)]


def kind_of(chain: Chain, hook: Any) -> HookKind | None:
    cls = type(hook)
    if not cls.__module__.startswith(chain.module_prefix):
        return None
    return _KINDS.get((chain.library, cls.__name__))


def _an(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _label(chain: Chain, label: str, hook: Any) -> str:
    name = type(hook).__name__
    return f"{label}: {name}" if label and label != name else name


def hook_names(module: nn.Module) -> list[str]:
    """The module's hooks, outermost first, each with its library."""
    found = chain_of(module)
    if found is None:
        return []
    chain, hooks = found
    return [f"{chain.library} {_label(chain, label, h)}" for label, h in hooks]


def hook_problem(module: nn.Module, role: str = "around") -> str | None:
    """Why the module's hooks are not ones streamplan can sit inside (``role="around"``: the module is streamed) or
    run around a graph (``role="weights"``: a leaf inside a captured block), or None. None too when the module has no
    hook chain: the caller judges its forward then."""
    found = chain_of(module)
    if found is None:
        return None
    chain, hooks = found
    others = [lib for lib in libraries_on(module) if lib != chain.library]
    if others:   # which chain holds the other is not for streamplan to guess
        return f"forward is wrapped by both {chain.library} and {' and '.join(others)} hooks"
    for label, hook in hooks:
        kind = kind_of(chain, hook)
        what = _label(chain, label, hook)
        if kind is None:
            return f"{_an(chain.library)} hook streamplan does not know ({what})"
        if kind.stock:
            return f"{chain.library} hook {what}: {kind.stock}"
        if not getattr(kind, role):
            if role == "weights":   # a cache or guidance hook on a part: it decides whether the part runs, per call
                return (f"{chain.library} hook {what} decides per call whether this part runs or what it returns, "
                        "which a graph of the whole block (or a caller calling it per row chunk) cannot follow")
            return f"{chain.library} hook {what} is known only on parts, not around a streamed forward"
    return None


def install(module: nn.Module, wrapper: Callable[..., Any]) -> Callable[..., Any] | None:
    """Put ``wrapper`` where the module's own forward runs inside its hooks; returns the forward it replaced (the stock
    one, for stock fallbacks), or None when the module has no hook chain (the caller patches ``forward``)."""
    found = chain_of(module)
    if found is None:
        return None
    holder, attr = found[0].inner(module)
    previous = getattr(holder, attr)
    setattr(holder, attr, wrapper)
    return previous


def takes_described(module: nn.Module) -> bool:
    """Whether the forward streamplan installed on ``module`` (inside its hooks or not) takes described inputs
    (``RowMask``, ``HostRows``) and builds them whole for a stock call."""
    found = chain_of(module)
    forward = getattr(*found[0].inner(module)) if found is not None else module.__dict__.get("forward")
    return bool(getattr(forward, DESCRIBED_MARK, False))


def uninstall(module: nn.Module, wrapper: Callable[..., Any], previous: Callable[..., Any]) -> bool:
    """Take ``wrapper`` out of the module's hook chain, wherever hooks added or removed since have moved it, and put
    ``previous`` back; False when it is not in any chain."""
    for chain in _CHAINS:
        for holder, attr in chain.links(module):
            if getattr(holder, attr, None) is wrapper:
                setattr(holder, attr, previous)
                return True
    return False


def leaf_hooks(module: nn.Module) -> list[tuple[nn.Module, list]]:
    """The hooked modules inside ``module`` (not itself), each with its hooks outermost first."""
    found = []
    for name, m in module.named_modules():
        if name and (c := chain_of(m)) is not None:
            found.append((m, [h for _, h in c[1]]))
    return found


@contextlib.contextmanager
def onloaded(module: nn.Module) -> Iterator[None]:
    """The hooked leaves inside ``module`` with their weights put in place by their own hooks' ``pre_forward`` (as
    their calls would), their chains set aside so a capture traces their class forwards; ``post_forward`` after
    (offload, cast back for storage), innermost hook first, as a call ends."""
    entered: list[tuple[nn.Module, list, Any]] = []
    try:
        for m, chain in leaf_hooks(module):
            for hook in chain:
                hook.pre_forward(m)
            entered.append((m, chain, m.__dict__.pop("forward")))
        yield
    finally:
        for m, chain, forward in reversed(entered):
            m.forward = forward
            for hook in reversed(chain):
                hook.post_forward(m, None)


def rehearsal_problem(module: nn.Module) -> str | None:
    """Why a forward with this module inside cannot be rehearsed with its hooks set aside (None: it can): a hook that
    does more than move weights or inputs (a cache deciding whether a block runs) must run, and on fake tensors it
    would keep them; PyTorch hooks the same."""
    found = chain_of(module)
    if found is not None:
        chain, hooks = found
        odd = [_label(chain, label, h) for label, h in hooks if not getattr(kind_of(chain, h), "rehearsed", False)]
        if odd:
            return f"{chain.library} hooks ({', '.join(odd)})"
    elif libraries_on(module):
        return f"{' and '.join(libraries_on(module))} hooks"
    found_torch = torch_hooks(module)
    return ", ".join(found_torch) if found_torch else None


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one (a bare ``cuda`` is the current one)."""
    a, b = (torch.device(d) for d in (a, b))
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else None
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def brought(root: nn.Module) -> list[tuple[nn.Module, Brought]]:
    """What every hook in ``root`` brings onto the device for its call, with the module it sits on."""
    found = []
    for m in root.modules():
        c = chain_of(m)
        for _, hook in (c[1] if c else ()):
            kind = kind_of(c[0], hook)
            got = kind.brings(hook, m) if kind is not None and kind.brings is not None else None
            if got is not None and got.tensors:
                found.append((m, got))
    return found


def weights_in_flight(root: nn.Module) -> int:
    """The most weight bytes hooks hold on the device at once during ``root``'s call: what they bring for the whole
    call (hooks on ``root`` itself), the largest streamed unit's (a block's group, or all the leaves inside a block:
    ``onloaded`` brings them together), and where a library brings the next while one runs, the largest one more."""
    items = brought(root)
    whole = {b.key: b.nbytes for m, b in items if m is root}
    units: dict[int, dict[int, int]] = {}
    for m, b in items:
        if m is not root:
            units.setdefault(id(_unit(root, m)), {})[b.key] = b.nbytes
    largest = max((sum(u.values()) for u in units.values()), default=0)
    ahead = max((b.nbytes for m, b in items if m is not root and b.ahead), default=0)
    return sum(whole.values()) + largest + ahead


def release_all(root: nn.Module) -> None:
    """Every hook in ``root`` puts back what it brought (a refused call's outer hooks onloaded the model's own weights
    and prefetched the first block's, and will not run their after-call): the model as it was before the call."""
    for m in root.modules():
        c = chain_of(m)
        for _, hook in (c[1] if c else ()):
            kind = kind_of(c[0], hook)
            if kind is not None and kind.release is not None:
                kind.release(hook, m)


def _unit(root: nn.Module, m: nn.Module) -> nn.Module:
    """The streamed module whose call brings ``m``'s weights (the outermost streamed one holding it, below root, that
    is not a model forward: one calls its children one at a time), or ``m`` itself."""
    for name, sub in root.named_modules():
        if sub is root or not _marked(sub, STREAMED_MARK) or _marked(sub, MODEL_MARK):
            continue
        if any(x is m for x in sub.modules()):
            return sub
    return m


def _marked(m: nn.Module, mark: str) -> bool:
    """Whether ``m``'s streamplan forward (its forward, or the innermost link of its hook chain) carries ``mark``."""
    return bool(getattr(m.__dict__.get("forward"), mark, False)) or _inner_marked(m, mark)


def _inner_marked(m: nn.Module, mark: str) -> bool:
    found = chain_of(m)
    if found is None:
        return False
    holder, attr = found[0].inner(m)
    return bool(getattr(getattr(holder, attr), mark, False))


@contextlib.contextmanager
def set_aside(root: nn.Module, stand_in: Callable[[torch.Tensor, torch.device, torch.dtype], torch.Tensor]):
    """Every hook chain inside ``root`` set aside (a module runs its innermost link: a streamed forward, or its own)
    and every tensor the hooks would bring stood in on its device by ``stand_in(t, device, dtype)``; put back after.
    A rehearsal runs so: the hooks never see fake tensors and the model's real weights are never touched."""
    forwards: list[tuple[nn.Module, Any]] = []
    slots: list[tuple[dict, str, Any]] = []
    try:
        wanted = {}
        for _, b in brought(root):
            for t in b.tensors:
                if not same_device(t.device, b.device) or (b.dtype or t.dtype) != t.dtype:
                    wanted[id(t)] = (b.device, b.dtype or t.dtype)
        for m in root.modules():
            for holder in (m._parameters, m._buffers):
                for k, t in list(holder.items()):
                    if t is not None and id(t) in wanted:
                        slots.append((holder, k, t))
                        new = stand_in(t, *wanted[id(t)])
                        holder[k] = nn.Parameter(new, requires_grad=False) if holder is m._parameters else new
        for m in root.modules():
            c = chain_of(m)
            if c is None:
                continue
            inner = getattr(*c[0].inner(m))
            forwards.append((m, m.__dict__["forward"]))
            if getattr(inner, "__self__", None) is m and getattr(inner, "__func__", None) is type(m).forward:
                del m.__dict__["forward"]   # no chain left: the class forward runs, as a capture sees it
            else:
                m.__dict__["forward"] = inner
        yield
    finally:
        for m, forward in reversed(forwards):
            m.__dict__["forward"] = forward
        for holder, k, t in reversed(slots):
            holder[k] = t


def streamed_inside(module: nn.Module) -> bool:
    """Whether the innermost link of the module's hook chain is already a streamplan forward."""
    return _inner_marked(module, STREAMED_MARK)


def _first(module: nn.Module, keep: Callable[[HookKind | None], bool]) -> str | None:
    found = chain_of(module)
    if found is None:
        return None
    chain, hooks = found
    for label, hook in hooks:
        if keep(kind_of(chain, hook)):
            return _label(chain, label, hook)
    return None


def holding_inputs(module: nn.Module) -> str | None:
    """The first of the module's hooks not known to let go of its inputs (a cache hook subtracts the input from the
    output after the forward), or None: a streamed module may overwrite its input only then."""
    return _first(module, lambda k: k is None or not k.lets_go)


def keeps_output(module: nn.Module) -> str | None:
    """The first of the module's hooks that keeps a reference to its output (a cache storing it for later steps), or
    None: a model forward may donate the module's output to the next block only then."""
    return _first(module, lambda k: k is None or k.keeps_output)


def torch_hooks(m: nn.Module) -> list[str]:
    """The PyTorch hooks registered on ``m`` itself, by kind."""
    found = []
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        if getattr(m, attr, None):
            found.append(attr.strip("_").replace("_", " "))
    return found


def hooks_added_inside(module: nn.Module) -> str | None:
    """PyTorch hooks on a block or its parts at call time (transformers adds output-capturing hooks when hidden states
    are asked for): a capture would fire them on fake tensors, and a streamed graph would skip them."""
    for name, m in module.named_modules():
        found = torch_hooks(m)
        if found:
            return f"{name or 'the block'} has {', '.join(found)} at call time"
    return None
