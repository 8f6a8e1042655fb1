"""``apply`` and the reversible ``StreamHandle`` (in the manner of accelerate's hooks)."""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .budget import parse_budget
from .executors.mlp import run_mlp
from .ir import MLPSpec, Skip
from .planner import MLPPlan, plan_mlp
from .recognize import recognize
from .recognize.checks import STREAMED_MARK

log = logging.getLogger("streamplan")

_MISSING = object()


@dataclass
class StreamOptions:
    budget: int | None = None
    chunk_tokens: int | None = None
    ffn_slice: int | None = None


@dataclass(eq=False)
class Installed:
    name: str
    module: nn.Module
    spec: MLPSpec
    stock: Callable[..., Any]
    previous: Any  # what module.__dict__["forward"] held before, or _MISSING
    plans: dict[tuple, MLPPlan] = field(default_factory=dict)
    runtime_notes: list[str] = field(default_factory=list)


def _positive_int(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int (rows or features per chunk), got {value!r}")
    return value


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

    # -- installation -------------------------------------------------------------------------------
    def _install(self, name: str, spec: MLPSpec) -> None:
        module = spec.module
        previous = module.__dict__.get("forward", _MISSING)
        stock = module.forward
        entry = Installed(name, module, spec, stock, previous)

        @functools.wraps(type(module).forward)
        def streamed_forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(entry, args, kwargs)

        setattr(streamed_forward, STREAMED_MARK, True)
        module.forward = streamed_forward
        self.installed[name] = entry

    def _run(self, entry: Installed, args: tuple, kwargs: dict) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return entry.stock(*args, **kwargs)
        x = args[0]
        if _needs_grad(entry.module, x):
            self._note(entry, "autograd is recording: ran stock (streamed executors are for inference)")
            return entry.stock(x)
        rows = x.numel() // x.shape[-1]
        sig = (tuple(x.shape), x.dtype, x.device.type)
        plan = entry.plans.get(sig)
        if plan is None:
            o = self.options
            plan = plan_mlp(entry.spec, rows, x.element_size(), chunk_tokens=o.chunk_tokens,
                            ffn_slice=o.ffn_slice, budget=o.budget)
            entry.plans[sig] = plan
            log.info("streamplan: %s planned for %s: %s", entry.name or type(entry.module).__name__,
                     tuple(x.shape), plan.describe())
        if plan.tier == "L0":
            return entry.stock(x)
        return run_mlp(entry.spec, plan, entry.stock, x)

    @staticmethod
    def _note(entry: Installed, note: str) -> None:
        if note not in entry.runtime_notes:
            entry.runtime_notes.append(note)
            log.info("streamplan: %s: %s", entry.name, note)

    # -- public -------------------------------------------------------------------------------------
    @property
    def plans(self) -> dict[str, list[MLPPlan]]:
        return {name: list(e.plans.values()) for name, e in self.installed.items()}

    def remove(self) -> None:
        """Restore the stock forwards (the same function objects as before ``apply``)."""
        for entry in self.installed.values():
            if entry.previous is _MISSING:
                entry.module.__dict__.pop("forward", None)
            else:
                entry.module.forward = entry.previous
        self.installed.clear()
        self.removed = True

    def to_json(self) -> str:
        return json.dumps({
            "streamed": {n: {"class": type(e.module).__name__, "recognized_as": e.spec.label,
                             "plans": [{"shape": list(s[0]), "dtype": str(s[1]), **p.to_dict()}
                                       for s, p in e.plans.items()]}
                         for n, e in self.installed.items()},
            "stock": [{"name": s.name, "class": s.cls, "reason": s.reason} for s in self.skipped],
        }, indent=2)

    def report(self) -> str:
        root = type(self.root).__name__
        lines = [f"streamplan report for {root}"]
        if self.removed:
            lines.append("  handle removed: the model runs its stock forwards")
        if not self.installed and not self.removed:
            lines.append(f"  nothing recognised in {root}: the model is untouched")
        for name, e in self.installed.items():
            lines.append(f"  streamed  {name or '<root>'}  ({type(e.module).__name__} as {e.spec.label})")
            if not e.plans:
                lines.append("      not called yet: planned at the first call per input shape")
            for sig, plan in e.plans.items():
                lines.append(f"      input {list(sig[0])} {str(sig[1]).replace('torch.', '')}: {plan.describe()}")
            for note in e.runtime_notes:
                lines.append(f"      note: {note}")
        for s in self.skipped:
            lines.append(f"  stock     {s.name or '<root>'}  ({s.cls}): {s.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<StreamHandle {len(self.installed)} streamed, {len(self.skipped)} left stock>"


def apply(module: nn.Module, budget: int | str | None = None, chunk_tokens: int | None = None, *,
          ffn_slice: int | None = None) -> StreamHandle:
    """Stream every recognised structure inside ``module`` in place; returns a handle to report and undo.

    ``budget`` (bytes, ``"12GiB"``, ``"auto"``) lets the planner pick tiers and chunks; ``chunk_tokens`` forces
    row streaming at that chunk; ``ffn_slice`` forces feature-sliced MLPs with that many hidden features per slice.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    chunk_tokens = _positive_int(chunk_tokens, "chunk_tokens")
    ffn_slice = _positive_int(ffn_slice, "ffn_slice")
    device = next((p.device for p in module.parameters()), None)
    options = StreamOptions(parse_budget(budget, device), chunk_tokens, ffn_slice)
    specs, skipped = recognize(module)
    handle = StreamHandle(module, options, skipped)
    try:
        for name, spec in specs.items():
            handle._install(name, spec)
    except BaseException:
        handle.remove()
        raise
    log.info("streamplan: %d module(s) streamed, %d left stock", len(handle.installed), len(skipped))
    return handle
