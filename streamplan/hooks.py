"""streamplan among diffusers hooks (``diffusers.hooks.HookRegistry``).

A module with a registry has its forward replaced by the registry's chain: each hook's ``pre_forward``, then the next
hook in, down to the module's own forward, then each ``post_forward`` on the way out (a hook with ``new_forward``,
such as a cache, calls ``fn_ref.original_forward`` itself, or not). streamplan puts its streamed forward in place of
that innermost link, where the stock forward ran: the offload hook onloads the weights before it, a cache hook decides
whether it runs at all. Hooks registered later wrap outside it, as they would wrap the stock forward; ``uninstall``
finds the link wherever the chain holds it by then.

Hooks on the leaves inside a captured block (leaf-level group offloading, layerwise casting) act when each leaf is
called; the captured graph reads the leaves' weights directly, so ``onloaded`` runs those hooks' ``pre_forward`` for
every leaf before the capture and the graph run and their ``post_forward`` after: the block's weights are on the
execution device (and in the compute dtype) for the whole streamed call, as block-level offloading has them. Only
hook classes named here are accepted; any other keeps the module stock, named (``hook_problem``).

accelerate's hooks (``add_hook_to_module``) keep the module's own forward in ``module._old_forward``: that is the
innermost link there, and sequential CPU offload's ``AlignDevicesHook`` on the leaves is onloaded the same way."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch import nn

# hooks that may wrap a streamed module's own forward: they move weights or inputs, or decide whether it runs
AROUND = {"GroupOffloadingHook", "LazyPrefetchGroupOffloadingHook", "LayerExecutionTrackerHook",
          "LayerwiseCastingHook", "FBCHeadBlockHook", "FBCBlockHook"}
# hooks on a leaf inside a captured block that only put its weights in place (no effect on its inputs' values or its
# output beyond the weights' device and dtype): run around the graph by ``onloaded``
WEIGHTS = {"GroupOffloadingHook", "LayerExecutionTrackerHook", "LayerwiseCastingHook"}

# hooks known to keep no reference to the module's inputs past its forward (a donated input may be overwritten)
LET_GO = {"GroupOffloadingHook", "LazyPrefetchGroupOffloadingHook", "LayerExecutionTrackerHook",
          "LayerwiseCastingHook"}


# accelerate: the hook that loads a module's own weights from the offload map (sequential CPU offload)
ACCELERATE = {"AlignDevicesHook"}


def accelerate_hook(module: nn.Module) -> Any | None:
    """The module's accelerate hook when ``module.forward`` is accelerate's wrapper around ``_old_forward``."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None or "_old_forward" not in module.__dict__ or "forward" not in module.__dict__:
        return None
    return hook


def accelerate_problem(module: nn.Module) -> str | None:
    """Why the module's accelerate hook is not one streamplan can sit inside or onload around, or None."""
    hook = accelerate_hook(module) or getattr(module, "_hf_hook", None)
    cls = type(hook)
    if accelerate_hook(module) is None or cls.__name__ not in ACCELERATE or not cls.__module__.startswith("accelerate"):
        return f"is wrapped by an accelerate hook ({cls.__name__})"
    return None


def registry(module: nn.Module) -> Any | None:
    """The module's diffusers ``HookRegistry`` when it holds hooks and its chain is what ``module.forward`` runs."""
    reg = module.__dict__.get("_diffusers_hook")
    if reg is None or not getattr(reg, "_fn_refs", None) or "forward" not in module.__dict__:
        return None
    return reg


def hook_names(module: nn.Module) -> list[str]:
    """The module's diffusers hooks, outermost first (as a call meets them), or its accelerate hook."""
    if accelerate_hook(module) is not None:
        return [f"accelerate {type(accelerate_hook(module)).__name__}"]
    reg = registry(module)
    return [f"{n} ({type(reg.hooks[n]).__name__})" for n in reversed(reg._hook_order)] if reg is not None else []


def hook_problem(module: nn.Module, allowed: set[str]) -> str | None:
    """Why the module's diffusers hooks are not ones streamplan can sit among (``allowed`` class names), or None.
    None too when the module has no registry: the caller judges its forward then."""
    reg = registry(module)
    if reg is None:
        return None
    for name in reg._hook_order:
        cls = type(reg.hooks[name])
        if cls.__name__ not in allowed or not cls.__module__.startswith("diffusers.hooks"):
            return f"a diffusers hook streamplan does not know ({name}: {cls.__name__})"
    return None


def _inner(reg: Any) -> tuple[Any, str]:
    """The innermost link of the chain: the reference that calls the module's own forward, and its attribute."""
    ref = reg._fn_refs[0]
    return ref, ("original_forward" if ref.original_forward is not None else "forward")


def install(module: nn.Module, wrapper: Callable[..., Any]) -> Callable[..., Any] | None:
    """Put ``wrapper`` where the module's own forward runs inside its diffusers hooks; returns the forward it replaced
    (the stock one, for stock fallbacks), or None when the module has no hooks (the caller patches ``forward``)."""
    if accelerate_hook(module) is not None:
        previous = module.__dict__["_old_forward"]
        module._old_forward = wrapper
        return previous
    reg = registry(module)
    if reg is None:
        return None
    ref, attr = _inner(reg)
    previous = getattr(ref, attr)
    setattr(ref, attr, wrapper)
    return previous


def uninstall(module: nn.Module, wrapper: Callable[..., Any], previous: Callable[..., Any]) -> bool:
    """Take ``wrapper`` out of the module's hook chain, wherever hooks added or removed since have moved it, and put
    ``previous`` back; False when it is not in the chain."""
    if module.__dict__.get("_old_forward") is wrapper:
        module._old_forward = previous
        return True
    reg = module.__dict__.get("_diffusers_hook")
    for ref in getattr(reg, "_fn_refs", ()) or ():
        for attr in ("original_forward", "forward"):
            if getattr(ref, attr) is wrapper:
                setattr(ref, attr, previous)
                return True
    return False


def leaf_hooks(module: nn.Module) -> list[tuple[nn.Module, list]]:
    """The hooked modules inside ``module`` (not itself), each with its hooks outermost first."""
    found = []
    for name, m in module.named_modules():
        if not name:
            continue
        if accelerate_hook(m) is not None:
            found.append((m, [accelerate_hook(m)]))
        elif (reg := registry(m)) is not None:
            found.append((m, [reg.hooks[n] for n in reversed(reg._hook_order)]))
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


def streamed_inside(module: nn.Module) -> bool:
    """Whether the innermost link of the module's hook chain is already a streamplan forward."""
    from .recognize.checks import STREAMED_MARK
    if accelerate_hook(module) is not None:
        return bool(getattr(module.__dict__["_old_forward"], STREAMED_MARK, False))
    reg = registry(module)
    if reg is None:
        return False
    ref, attr = _inner(reg)
    return bool(getattr(getattr(ref, attr), STREAMED_MARK, False))


def holding_inputs(module: nn.Module) -> str | None:
    """The first of the module's hooks not known to let go of its inputs (a cache hook subtracts the input from the
    output after the forward), or None."""
    reg = registry(module)
    for name in reversed(reg._hook_order) if reg is not None else ():
        if type(reg.hooks[name]).__name__ not in LET_GO:
            return f"{name} ({type(reg.hooks[name]).__name__})"
    return None
