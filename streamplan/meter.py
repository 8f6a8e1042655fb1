"""Peak tensor memory of a call, on CPU (profiler memory events) and CUDA (allocator counters)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

__all__ = ["measure_peak"]


def _infer_device(args: tuple, kwargs: dict) -> torch.device:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, torch.nn.Module):
            for p in value.parameters():
                return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _quiet_stderr():
    """The CPU allocator warns once per pre-existing block freed in the window; that is expected here."""
    try:
        fd = os.dup(2)
    except OSError:  # no real stderr (embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def profiler_peak(fn: Callable[..., Any], args: tuple, kwargs: dict, device_type: str = "cpu") -> tuple[Any, int]:
    """Peak from the profiler's allocation events on ``device_type`` (how CPU peaks are measured; on CUDA it is
    checked against the allocator's own counters by ``benchmarks/gpu_attention.py``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with _quiet_stderr(), profile(activities=activities, profile_memory=True) as prof:
        result = fn(*args, **kwargs)
        if device_type == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).lower().endswith(device_type)]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak


def _cuda_peak(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, int]:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return result, max(0, torch.cuda.max_memory_allocated(device) - base)


def measure_peak(fn: Callable[..., Any], *args: Any, device: torch.device | str | None = None,
                 **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak_bytes)``.

    ``peak_bytes`` is the highest amount of tensor memory allocated during the call above what was live
    when it started. The device is the first tensor argument's (or module's) unless ``device`` is given;
    with no tensors, CUDA when available.
    """
    if not callable(fn):
        raise ValueError(f"measure_peak: fn must be callable, got {type(fn).__name__}")
    dev = torch.device(device) if device is not None else _infer_device(args, kwargs)
    if dev.type == "cuda":
        return _cuda_peak(fn, args, kwargs, dev)
    if dev.type == "cpu":
        return profiler_peak(fn, args, kwargs, "cpu")
    raise ValueError(f"measure_peak: device {dev} is not supported (use cpu or cuda)")
