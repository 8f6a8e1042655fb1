"""Shared helpers for GPU benchmarks: timing with CUDA events, peaks from the CUDA allocator, result files."""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Callable

import torch

from streamplan.bench import cuda_time  # noqa: F401  (the suite's timing, shared)


def device_info() -> dict:
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def cuda_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Peak bytes allocated during ``fn`` above what was allocated before, straight from the allocator."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def write_results(name: str, payload: dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
