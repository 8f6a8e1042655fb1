"""What a hand-written recognizer of a diffusers attention checks before it takes a module apart by following its
processor's source: the module's stock forward untouched (``recognize.checks.stock_problem``), and the sources it
follows unchanged since the diffusers it was written against (their fingerprints)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ...recognize.checks import call_args, source_fingerprint, stock_problem
from ...specs import AttentionSpec

FOLLOWED_VERSION = "0.42.1"


def processor_call(names: tuple[str, ...], processor, args: tuple, kwargs: dict) -> dict | str:
    """A followed processor's call by argument name, or why the binder cannot take it: arguments it does not know,
    or the processor under diffusers' context parallelism (its attention exchanges rows across ranks)."""
    call = call_args(names, args, kwargs)
    if isinstance(call, str):
        return call
    return "under diffusers' context parallelism" if getattr(processor, "_parallel_config", None) is not None else call


def unfollowed(module: nn.Module, forward: Callable, sources: dict[str, Callable],
               followed: dict[str, str]) -> str | None:
    """Why ``module`` may not be taken apart (None: it may): its forward patched or hooked, or a source it follows
    (name -> function) whose fingerprint is not the one recorded in ``followed``."""
    problem = stock_problem(module, forward)
    if problem:
        return problem
    changed = [name for name, fn in sources.items() if source_fingerprint(fn) != followed[name]]
    if changed:
        return f"{', '.join(changed)} differ from the diffusers {FOLLOWED_VERSION} source streamplan follows"
    return None


def followed_spec(module: nn.Module, label: str, heads: int, inner: int, out: nn.Linear, bind: Callable,
                  backend: str) -> AttentionSpec:
    """The spec of an attention a recognizer follows by its processor's source: as many K/V heads as query heads
    (``inner`` features over ``heads``), its output projection ``out``, its call bound by ``bind(args, kwargs)``."""
    return AttentionSpec(module=module, label=label, heads=heads, kv_heads=heads, head_dim=inner // heads,
                         dim_out=out.out_features, bind=bind, backend=lambda: backend)
