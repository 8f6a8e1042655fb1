"""Peak tensor memory of a call, on CPU (profiler memory events) and CUDA (allocator counters)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["measure_peak", "range_peak", "RangePeak"]

logger = logging.getLogger(__name__)

RANGE_PREFIX = "streamplan/"   # profiler ranges named so are streamplan's (``execute.call_ledger``): the meter's peaks


def _infer_device(args: tuple, kwargs: dict) -> torch.device:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, torch.nn.Module):
            for p in value.parameters():
                return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# What the profiler itself writes to fd 2 from C++ (not through Python's warnings, so it cannot be filtered there):
# Kineto's log lines at each profiler start and stop (USDT; STAGE in older torch), and the CPU allocator's warning when
# a block allocated before the window is freed inside it (expected here: the meter counts only what the call adds).
_PROFILER_NOISE = re.compile(
    r"^(?:USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] "
    r"|^\[W[^\]]*CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling started")


@contextlib.contextmanager
def _filtered_stderr():
    """Hold what is written to fd 2 during the window in a temporary file, then write every line of it back to the real
    stderr except the profiler's own noise (``_PROFILER_NOISE``): the caller's output and warnings are kept, only
    later (after the call)."""
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as held:
        _flush_stderr()
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            dropped = 0
            for line in held:
                if _PROFILER_NOISE.match(line.decode("utf-8", "replace")):
                    dropped += 1
                else:
                    _write_all(2, line)
            if dropped:
                logger.debug("measure_peak: dropped %d line(s) of profiler noise from stderr", dropped)


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def profiler_peak(fn: Callable[..., Any], args: tuple, kwargs: dict, device_type: str = "cpu") -> tuple[Any, int]:
    """Peak from the profiler's allocation events on ``device_type`` (how CPU peaks are measured; on CUDA it is
    checked against the allocator's own counters by ``benchmarks/gpu_attention.py``)."""
    from torch.profiler import ProfilerActivity, profile

    if torch._C._autograd._profiler_enabled():
        # A second profiler inside a running one does not see the call's events reliably (the inner window can read
        # almost nothing), so a nested CPU measurement would be a wrong number, not a smaller one.
        raise RuntimeError("measure_peak: a CPU measurement cannot run inside another one (or inside a running "
                           "torch.profiler); measure the inner call in a separate run")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with _filtered_stderr(), profile(activities=activities, profile_memory=True) as prof:
        result = fn(*args, **kwargs)
        if device_type == "cuda":
            torch.cuda.synchronize()
    allocations, ranges = _events(prof, device_type)
    peak = _window_peak(allocations)
    _publish(_range_peaks(allocations, ranges, peak))
    return result, peak


def _events(prof, device_type: str) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """(time, address, bytes; negative: freed) of every allocation event on ``device_type`` in the window, and
    (name, start, end) of every streamplan range in it (``execute.call_ledger``), from the profiler's event tree
    (every torch this project supports has it)."""
    from torch._C._profiler import _EventType

    found, ranges, todo = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == device_type:
            found.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        elif e.tag == _EventType.TorchOp and e.name.startswith(RANGE_PREFIX):
            ranges.append((e.name, e.start_time_ns, e.end_time_ns))
    found.sort(key=lambda a: a[0])
    return found, ranges


@dataclass(frozen=True)
class RangePeak:
    """A streamed call's (or one of its phases') memory as the meter saw it, in bytes above what was live when the
    measurement began: ``start`` when the range began, ``peak`` the most alive at once within it (at least
    ``start``); ``own`` is what the call added above what was live when it began (its inputs were already live).
    ``call_peak``: the whole measured call's peak, what ``measure_peak`` returned for it."""

    start: int
    peak: int
    call_peak: int

    @property
    def own(self) -> int:
        return self.peak - self.start


def _range_peaks(allocations: list[tuple[int, int, int]], ranges: list[tuple[str, int, int]],
                 call_peak: int) -> dict[str, RangePeak]:
    """Each range's ``RangePeak`` from the window's allocations, counted as ``_window_peak`` counts them."""
    if not ranges:
        return {}
    import bisect

    import numpy as np
    times, lives = [], []
    mine: dict[int, int] = {}
    live = 0
    for t, ptr, size in allocations:
        if size > 0:
            mine[ptr] = size
            live += size
        elif ptr in mine:
            live -= mine.pop(ptr)
        times.append(t)
        lives.append(live)
    curve = np.asarray(lives, dtype=np.int64)
    out = {}
    for name, t0, t1 in ranges:
        i0, i1 = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        start = int(curve[i0 - 1]) if i0 > 0 else 0
        peak = max(start, int(curve[i0:i1].max())) if i1 > i0 else start
        out[name] = RangePeak(start, peak, call_peak)
    return out


MAX_RANGES = 50_000   # ranges kept from the latest measurements (older ones dropped first)
_RANGES: "OrderedDict[str, RangePeak]" = OrderedDict()


def _publish(found: dict[str, RangePeak]) -> None:
    _RANGES.update(found)
    while len(_RANGES) > MAX_RANGES:
        _RANGES.popitem(last=False)


def range_peak(name: str) -> RangePeak | None:
    """What the profiler-based meter measured for a streamed call's range (``execute.call_ledger``: each call's
    ``tag``, and ``tag/phase``), or None where that call was not measured so."""
    return _RANGES.get(name)


def _window_peak(allocations: list[tuple[int, int, int]]) -> int:
    """The most bytes allocated inside the window and alive at once. A block freed in the window that was allocated
    before it (garbage of an earlier call collected now) does not offset what the call allocates: the profiler knows
    its size when an earlier profiled window allocated it, and counting it would read a first call far short."""
    mine: dict[int, int] = {}
    live = peak = 0
    for _, ptr, size in allocations:
        if size > 0:
            mine[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in mine:
            live -= mine.pop(ptr)
    return peak


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
    with no tensors, CUDA when available. On CPU the peak comes from the profiler, whose C++ side writes its own
    messages to stderr: during the call, stderr (fd 2) is held in a temporary file and written out when the call
    returns, those messages left out; everything else the call writes, warnings included, is kept.
    """
    if not callable(fn):
        raise ValueError(f"measure_peak: fn must be callable, got {type(fn).__name__}")
    dev = torch.device(device) if device is not None else _infer_device(args, kwargs)
    if dev.type == "cuda":
        return _cuda_peak(fn, args, kwargs, dev)
    if dev.type == "cpu":
        return profiler_peak(fn, args, kwargs, "cpu")
    raise ValueError(f"measure_peak: device {dev} is not supported (use cpu or cuda)")
