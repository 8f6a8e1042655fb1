"""What the streamed calls of a model's last call did, for ``StreamHandle.timeline``: one record per streamed module
call (the plan it ran, its wall time, the phases it went through) and, while the profiler-based meter is running
(``streamplan.measure_peak`` on CPU, ``meter.profiler_peak``), one named profiler range per call and per phase, from
which the meter reads each call's measured peak afterwards (``meter.range_peak``). Nothing is added per chunk: a
record and two clock reads per module call, a range per call and phase only while the profiler runs."""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..meter import RANGE_PREFIX
from .call_state import rehearsing

MAX_RECORDS = 20_000           # records a handle keeps of its last call (a long generate loop's calls each start anew)
_TAGS = itertools.count(1)


@dataclass(eq=False)
class CallRecord:
    """One streamed module call of the last outermost call: ``tag`` names its profiler range (and ``tag/phase`` its
    phases'), by which the meter's measured peaks are found; ``plan`` is the plan it ran (None: it ran stock before
    planning, or nothing was planned)."""

    tag: str
    name: str                  # the module's name in the model ("": the model itself)
    cls: str                   # its class
    depth: int                 # streamed calls this one runs inside
    inputs: int = 0            # bytes of the call's inputs (what its predicted and measured figures stand on)
    plan: Any = None           # ``planner.Plan``
    sig: tuple | None = None
    seconds: float = 0.0       # wall time on the host clock (on CUDA, kernels may still run after it)
    phases: list[str] = field(default_factory=list)

    def saw(self, plan: Any, sig: tuple) -> None:
        """The plan this call runs (the largest, where one call plans more than once)."""
        if self.plan is None or plan.predicted_total >= self.plan.predicted_total:
            self.plan, self.sig = plan, sig


class _Open(threading.local):
    def __init__(self):
        self.stack: list[CallRecord] = []


OPEN = _Open()


def profiling() -> bool:
    """Whether a profiler (the meter's, on CPU) is running: ranges are opened only then."""
    return torch._C._autograd._profiler_enabled()


def new_record(name: str, cls: str, inputs: int = 0) -> CallRecord:
    return CallRecord(f"{RANGE_PREFIX}{next(_TAGS)}", name, cls, len(OPEN.stack), inputs)


@contextlib.contextmanager
def recorded(record: CallRecord | None) -> Iterator[None]:
    """The call of ``record`` runs within: its wall time kept, and its profiler range opened while the profiler
    runs. ``None``: nothing recorded (a rehearsal)."""
    if record is None:
        yield
        return
    OPEN.stack.append(record)
    started = time.perf_counter()
    try:
        with torch.profiler.record_function(record.tag) if profiling() else contextlib.nullcontext():
            yield
    finally:
        record.seconds = time.perf_counter() - started
        OPEN.stack.pop()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A phase of the innermost recorded call (phase KV, phase Q, a self-check's stock run): named in its record,
    and a profiler range of its own while the profiler runs."""
    record = OPEN.stack[-1] if OPEN.stack and not rehearsing() else None
    if record is None:
        yield
        return
    record.phases.append(name)
    with torch.profiler.record_function(f"{record.tag}/{name}") if profiling() else contextlib.nullcontext():
        yield


__all__ = ["CallRecord", "RANGE_PREFIX", "new_record", "recorded", "phase", "profiling"]
