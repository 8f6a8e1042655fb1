"""Shared helpers for GPU benchmarks; the measuring itself is the library's (timing, peaks, comparison)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from streamplan import measure_peak
from streamplan.tools.bench import cuda_time, header as device_info  # noqa: F401  (shared with the suite)
from streamplan.verify import compare_outputs


def script_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser for a benchmark script (nothing in it touches CUDA, so ``--help`` runs anywhere): the module
    docstring's first paragraph as the description, the command lines it quotes (its lines indented four spaces) as
    the epilog."""
    examples = "\n".join(line for line in doc.splitlines() if line.startswith("    "))
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   epilog="examples:\n" + examples if examples else None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def bare_options(argv: list[str], keys: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` with the older scripts' options in argparse's form: a ``key=value`` token whose key is in ``keys`` as
    ``--key=value`` (underscores as dashes), a bare word in ``flags`` as ``--word``; every other token as it is."""
    def option(token: str) -> str:
        key, eq, _ = token.partition("=")
        if (eq and key in keys) or (not eq and token in flags):
            return "--" + key.replace("_", "-") + token[len(key):]
        return token
    return [option(t) for t in argv]


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers (``3584,4224``)."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def int_or(*words: str) -> Callable[[str], int | str]:
    """argparse type: an integer, or one of ``words`` as it is."""
    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"neither an integer nor one of {', '.join(words)}: {text!r}" if words
                                             else f"not an integer: {text!r}") from None
    return parse


def name_list(names) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of ``names`` (a benchmark's cases)."""
    names = list(names)

    def parse(text: str) -> list[str]:
        got = text.split(",")
        unknown = [g for g in got if g not in names]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}: choose from {', '.join(names)}")
        return got
    return parse


def cuda_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Peak bytes allocated during ``fn`` above what was allocated before (the CUDA allocator's counters)."""
    return measure_peak(fn, device="cuda")


def timed_peak(fn: Callable[[], Any], device: str = "cuda") -> tuple[Any, int, float]:
    """(result, peak bytes above what was allocated before, seconds) of one run (``measure_peak`` synchronises)."""
    start = time.perf_counter()
    out, peak = measure_peak(fn, device=device)
    return out, peak, time.perf_counter() - start


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return compare_outputs(a, b)["output"]["rel"]


def write_results(name: str, payload: dict) -> str:
    """Write ``<name>.json`` under $OUT when set, else benchmarks/results/latest/: a new run replaces the current
    figure of its benchmark and case (archive the previous file by hand first: benchmarks/RESULTS.md, "How results
    are kept")."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results", "latest")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def wall_time(fn: Callable[[], Any], repeats: int = 2, reduce: Callable[[list[float]], float] = statistics.median
              ) -> float:
    """Wall seconds of ``fn`` over ``repeats`` runs after one warm-up, their median (the CPU smoke runs' cuda_time)
    or another ``reduce`` (``min``: host time on a shared machine, the run nothing else slowed)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return reduce(times)


STAGES = [("streamplan.integrations.transformers.decoders", "_rope"),
          ("streamplan.integrations.transformers.decoders", "_masks"),
          ("streamplan.integrations.transformers.decoders", "_norm_in_place"),
          ("streamplan.execute.graph_call", "_run_onloaded")]   # a captured block's whole streamed call


class stage_peaks:
    """Per-stage CUDA peaks of one call (how a held plan's overshoot was found in 2026-12-01's Gemma 2 run): each
    ``(module path, function name)`` in ``stages`` (functions streamplan calls through its module's globals) and
    each ``(label, module)`` in ``modules`` (a submodule's forward, e.g. an embedding: never a streamed block, whose
    forward streamplan owns) is wrapped to record the memory allocated before it, its peak and what it leaves, in
    GiB above the allocation when the context was entered. Synchronises around every stage: for diagnosis, not
    timing."""

    def __init__(self, stages: list[tuple[str, str]] = STAGES, modules: list[tuple[str, torch.nn.Module]] = ()):
        self.stages, self.modules, self.rows, self._undo = stages, list(modules), [], []

    def _wrap(self, label: str, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)
        in_dict = attr in getattr(owner, "__dict__", {})

        def probed(*args, **kwargs):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = original(*args, **kwargs)
            torch.cuda.synchronize()
            self.rows.append({"stage": label, "before_GiB": (before - self.base) / 2**30,
                              "peak_GiB": (torch.cuda.max_memory_allocated() - self.base) / 2**30,
                              "after_GiB": (torch.cuda.memory_allocated() - self.base) / 2**30})
            return out

        setattr(owner, attr, probed)
        self._undo.append((owner, attr, original, in_dict))

    def __enter__(self) -> "stage_peaks":
        import importlib
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        for path, name in self.stages:
            self._wrap(f"{path.rsplit('.', 1)[-1]}.{name}", importlib.import_module(path), name)
        for label, module in self.modules:
            self._wrap(label, module, "forward")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original, in_dict in reversed(self._undo):
            if in_dict:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo.clear()


def send_to_device_without_accelerate() -> None:
    """diffusers' group offloading imports accelerate's send_to_device only when accelerate is installed, and calls
    it on every hooked call: without accelerate, an equivalent (tensors in nested args moved, others as they are)."""
    from diffusers.hooks import group_offloading as go
    if hasattr(go, "send_to_device"):
        return
    from torch.utils._pytree import tree_map

    def send_to_device(obj, device, non_blocking=False, **_):
        return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, obj)
    go.send_to_device = send_to_device


# a simulated card's room above the budget for the caching allocator's rounding (``cap_card``)
CAP_ALLOWANCE = 256 << 20


def cap_card(limit: int | None) -> None:
    """Simulate a card of ``limit`` bytes (``set_per_process_memory_fraction``; None: the whole card again). No-op off
    CUDA."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if limit is None else min(1.0, limit / total))


def random_weights(module: torch.nn.Module, norm_suffixes: tuple[str, ...] = ("weight",), device=None) -> None:
    """Random weights for a model whose layers skip init (ComfyUI's ``comfy.ops``: uninitialised memory), the 1-D
    parameters named with ``norm_suffixes`` near 1. ``device``: where the numbers are drawn (the GPU for a many-layer
    model built on the CPU: minutes faster)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn_like(p) if device is None else torch.randn(p.shape, dtype=p.dtype, device=device)
            p.copy_(float(p.dim() == 1 and name.endswith(norm_suffixes)) + noise * 0.02)
