"""Shared helpers for GPU benchmarks; the measuring itself is the library's (timing, peaks, comparison)."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from streamplan import measure_peak
from streamplan.bench import cuda_time, header as device_info  # noqa: F401  (shared with the suite)
from streamplan.verify import compare_outputs


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
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def wall_time(fn: Callable[[], Any], repeats: int = 2) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs after one warm-up (the CPU smoke runs' cuda_time)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
