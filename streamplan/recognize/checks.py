"""Shared fail-closed checks: is this module running the forward we know, untouched?"""
from __future__ import annotations

import inspect
import types
from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

from ..execute import hook_chains
from ..execute.hook_chains import torch_hooks
from ..specs import STREAMED_MARK, Activation
from ..plan.weight_formats import linear_caps


def same_code(f: Callable, g: Callable) -> bool:
    """Two functions with the same bytecode, names and constants (the "Copied from" family of a library)."""
    f = inspect.unwrap(getattr(f, "__func__", f))
    g = inspect.unwrap(getattr(g, "__func__", g))
    cf, cg = getattr(f, "__code__", None), getattr(g, "__code__", None)
    if cf is None or cg is None:
        return False
    return cf.co_code == cg.co_code and cf.co_names == cg.co_names and cf.co_consts == cg.co_consts


def global_hook_problem() -> str | None:
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_module_registration_hooks"):
        if attr != "_global_module_registration_hooks" and getattr(_module_globals, attr, None):
            return f"a global module {attr.strip('_').replace('_', ' ')} is registered"
    return None


def stock_problem(module: nn.Module, expected_forward: Callable | None = None, *, subtree: bool = True,
                  onloads: bool = False, per_chunk: bool = False) -> str | None:
    """Why ``module`` cannot be streamed safely as a known structure, or None. ``subtree=False`` checks the module
    alone (a model whose forward streamplan replaces; its children are judged on their own). Known hooks on the module
    itself are fine (streamplan runs inside them, ``streamplan.execute.hook_chains``), but only weight hooks where the
    caller calls the module once per row chunk (``per_chunk``: a cache hook would count each chunk as a step); on
    modules inside it only when their weights are in place when read (``onloads``: the caller runs their weight hooks
    around its run, as a captured graph does, or calls those modules through their own forwards); a path that reads them
    directly must not pass it."""
    if module.training:
        return "in training mode (streamplan is for inference: call .eval())"
    if expected_forward is not None and not (type(module).forward is expected_forward
                                             or same_code(type(module).forward, expected_forward)):
        return f"{type(module).__name__}.forward is not the forward streamplan knows"
    problem = global_hook_problem()
    if problem:
        return problem
    for name, m in (module.named_modules() if subtree else [("", module)]):
        where = name or "the module"
        caps = linear_caps(m) if hasattr(m, "weight") else None
        if caps is not None and caps.rows:
            return f"{where} has {caps.name} weights: {caps.rows}"
        if getattr(m, "_compiled_call_impl", None) is not None:   # Module.compile / compile_repeated_blocks
            return f"{where} is compiled (torch.compile): its calls run under dynamo, which would trace the chunk loops"
        fwd = m.__dict__.get("forward")
        if fwd is not None and hook_chains.chain_of(m) is not None:
            problem = _library_hooks_problem(module, m, where, onloads, per_chunk)
            if problem:
                return problem
        elif fwd is not None:
            if getattr(fwd, STREAMED_MARK, False) and m is module:
                return "already streamed by another streamplan handle"
            libraries = hook_chains.libraries_on(m)
            if libraries:   # hooks whose chain is not what forward runs now (patched over, or half removed)
                return f"forward of {where} is patched over {' and '.join(libraries)} hooks"
            return f"forward of {where} is patched"
        hooks = torch_hooks(m)
        if hooks:
            return f"{where} has {', '.join(hooks)} streamplan does not know"
    return None


def _library_hooks_problem(module: nn.Module, m: nn.Module, where: str, onloads: bool, per_chunk: bool) -> str | None:
    if m is module:
        if hook_chains.streamed_inside(m):
            return "already streamed by another streamplan handle"
        return hook_chains.hook_problem(m, "weights" if per_chunk else "around")
    if not onloads:
        names = ", ".join(hook_chains.hook_names(m))
        return f"{where} is wrapped by hooks ({names}) and this path reads its weights directly"
    problem = hook_chains.hook_problem(m, "weights")
    return f"{where}: {problem}" if problem else None


def _elementwise_classes() -> tuple[type, ...]:
    classes: list[type] = [nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Hardswish, nn.ReLU6,
                           nn.LeakyReLU, nn.ELU, nn.Identity]
    try:
        from transformers import activations as ta
    except Exception:  # transformers missing or broken: its classes simply are not known
        return tuple(classes)
    for name in ("SiLUActivation", "GELUActivation", "GELUTanh", "PytorchGELUTanh", "NewGELUActivation",
                 "FastGELUActivation", "QuickGELUActivation", "AccurateGELUActivation", "ReLUSquaredActivation",
                 "ClippedGELUActivation", "LaplaceActivation", "MishActivation", "LinearActivation"):
        cls = getattr(ta, name, None)
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def elementwise(act: object) -> Activation | None:
    """The activation as a callable if it is known to act on each element alone, else None."""
    if isinstance(act, nn.Module):
        if type(act) in _elementwise_classes() and "forward" not in act.__dict__ and not torch_hooks(act):
            return act
        return None
    if isinstance(act, (types.FunctionType, types.BuiltinFunctionType)) and act in (
            torch.nn.functional.silu, torch.nn.functional.gelu, torch.nn.functional.relu, torch.tanh,
            torch.sigmoid):
        return act
    return None


def call_args(names: tuple[str, ...], args: tuple, kwargs: dict, *, aliases: dict[str, str] | None = None,
              extra: bool = False) -> dict | str:
    """A forward's arguments by name (``aliases`` renames deprecated keywords), or why they cannot be read.
    Unknown keywords are an error unless ``extra`` (then the caller judges them)."""
    if len(args) > len(names):
        return "more positional arguments than the forward takes"
    call = dict(zip(names, args))
    for k, v in kwargs.items():
        k = (aliases or {}).get(k, k)
        if k in call:
            return f"argument {k} given twice"
        call[k] = v
    unknown = set(call) - set(names)
    if unknown and not extra:
        return f"unexpected arguments {sorted(unknown)}"
    return call


def source_fingerprint(fn: Callable) -> str | None:
    """A short hash of a function's source text (stable across Python versions, unlike its bytecode); None when the
    source cannot be read."""
    import hashlib
    try:
        text = inspect.getsource(inspect.unwrap(getattr(fn, "__func__", fn)))
    except (OSError, TypeError):
        return None
    return hashlib.sha1(text.encode()).hexdigest()[:16]
