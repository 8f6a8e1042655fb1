"""Chunks replayed: a phase's chunks of one size run as one recorded CUDA graph after the first two. Why: at short
lengths under a tight budget a chunk is a few hundred rows, and each of its ~100 ops costs ~10 us of dispatch and
launch that its kernels no longer hide (docs/budgets-and-tiers.md, the time model); a graph replays them all in one
launch. The same kernels run on the same values, so the outputs are the eager chunks' bit for bit.

A graph reads and writes fixed addresses, so a chunk's rows are copied into staging buffers before each replay and its
outputs, which the graph writes into its own memory, are copied out after it (the planner prices both: ``Plan.replay``
and ``replay_row_bytes``). The first chunk runs eager (it lays out the whole buffers and checks fused chains); the
second runs eager on the capture stream (lazy initialisation happens outside the capture) and is then recorded; the
rest replay; a last chunk of another size runs eager. Recording that fails leaves the call's other chunks eager, and
the report says why.

Off CUDA (and in a rehearsal, on fake tensors) ``RerunRecorder`` runs the recorded chunk again through the same
staging: the memory the staging holds is the graph's, and the staging logic is checked on the CPU."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import fx

from ..graph.analyze import Rows, numel_besides

log = logging.getLogger(__name__)

# full-size chunks past the first two a phase needs before recording pays: the eager warm-up and the recording cost
# about two chunks' host time (the time model prices it: ``time_model.Rates.replay_setup``)
MIN_REPLAYS = 2

Outputs = dict[fx.Node, Any]
# devices whose plans the planner may replay on its own: CUDA, and meta planned as the benchmark device
RECORDS = ("cuda", "meta")


class RerunRecorder:
    """Records by running; replays by running again, the last run's outputs let go first (a graph writes its outputs
    over the last replay's: the memory a replay holds is one chunk's, as the recording's)."""

    def __init__(self, device: torch.device):
        self.fn: Callable[[], Outputs] | None = None
        self.outs: Outputs = {}
        self.failed = ""

    def record(self, fn: Callable[[], Outputs]) -> Outputs:
        self.fn, self.outs = fn, fn()
        return self.outs

    def replay(self) -> None:
        self.outs.clear()
        self.outs.update(self.fn())

    def close(self) -> None:
        self.fn, self.outs = None, {}


class CudaGraphRecorder:
    """A CUDA graph of one chunk's work, on its own memory pool, recorded on a side stream after one eager run there."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outs: Outputs = {}
        self.failed = ""   # why the recording failed (the warm-up's values stand)

    def record(self, fn: Callable[[], Outputs]) -> Outputs:
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            warm = fn()   # this chunk's values; lazy initialisation (cuBLAS workspaces, attention plans) done here
        current.wait_stream(self.stream)
        for value in warm.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.outs = fn()
            self.graph = graph
        except Exception as err:   # noqa: BLE001 - an op that cannot be recorded: this call's chunks run eager
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self.outs = {}
        return warm

    def replay(self) -> None:
        self.graph.replay()

    def close(self) -> None:
        self.graph, self.outs = None, {}   # the graph's pool goes with it


def recorder_for(device: torch.device, fake: bool) -> type:
    return CudaGraphRecorder if device.type == "cuda" and not fake else RerunRecorder


class ChunkReplay:
    """One phase's replay: which inputs are staged, the recorder, and what went wrong (``problem``)."""

    def __init__(self, device: torch.device, staged: Iterable[fx.Node], size: int, fake: bool = False):
        self.recorder = recorder_for(device, fake)(device)
        self.staged = tuple(staged)
        self.size = size            # the chunk rows the recording holds for
        self.static: dict[fx.Node, torch.Tensor] = {}
        self.eager_chunks = 1       # the first chunk lays out the buffers: eager
        self.problem = ""           # why recording failed (the call's other chunks ran eager)

    def takes(self, a: int, b: int) -> bool:
        if self.problem or b - a != self.size:
            return False
        if self.eager_chunks:
            self.eager_chunks -= 1
            return False
        return True

    def run(self, env: dict, fn: Callable[[dict], Outputs]) -> Outputs:
        """One chunk: ``env`` its inputs (staged ones copied into the staging buffers), ``fn`` its work on an
        environment; its outputs, eager (the recorded chunk) or the recording's, refilled by a replay."""
        if not self.static:
            for node in self.staged:
                value = env[node]
                self.static[node] = torch.empty_like(value, memory_format=torch.contiguous_format) \
                    if not value.is_contiguous() else torch.empty_like(value)
                self.static[node].copy_(value)
            staged = {**env, **self.static}
            outs = self.recorder.record(lambda: fn(dict(staged)))
            if self.recorder.failed:
                self.problem = self.recorder.failed
                log.info("chunk replay off for this call: %s", self.problem)
                self.close()
            return outs
        for node in self.staged:
            self.static[node].copy_(env[node])
        self.recorder.replay()
        return self.recorder.outs

    def close(self) -> None:
        self.recorder.close()
        self.static.clear()


def replay_problem(an, consumer, row_mask, host: dict, parallel: bool, whole_q: bool) -> str:
    """Why a captured block's chunks cannot be replayed ('': they can): a chunk's work must be the same ops on the
    same shapes at fixed addresses, with nothing read from where the chunk starts."""
    if not getattr(consumer, "replayable", False):
        return f"its attention consumer ({getattr(consumer, 'name', type(consumer).__name__)}) is not known to record"
    causes = [(an.reduced, "an attention reduced over the chunks (its merge carries from chunk to chunk)"),
              (an.halo != (0, 0), "convolutions along the rows (a chunk reads its neighbours' rows)"),
              (an.fixed_cuts, "rows cut at a fixed count (a chunk's side of the cut depends on where it starts)"),
              (an.input_writes, "in-place writes into the block's inputs"),
              (any(att.causal for att in an.attentions),
               "a causal attention (its keys depend on where a chunk starts)"),
              (row_mask is not None, "a mask over the rows (its part depends on where a chunk starts)"),
              (host, "host rows (L6)"), (parallel, "sequence parallelism (exchanges between ranks)"),
              (whole_q, "a whole-Q attention (phase Q reads rows of its output)")]
    return next((why for cond, why in causes if cond), "")


def staged_row_bytes(an, graph: fx.Graph) -> int:
    """Device bytes per row the staging holds: each input with rows copied in (the values read as inputs too), each
    output with rows copied out."""
    total = 0
    inputs = [n for n in graph.nodes if n.op == "placeholder"] + list(an.read_as_inputs)
    nodes = [n for n in inputs if n not in an.whole_inputs] + [o for o in an.outputs if isinstance(o, fx.Node)]
    for node in dict.fromkeys(nodes):
        r, val = an.rows.get(node), node.meta.get("val")
        if isinstance(r, Rows) and isinstance(val, torch.Tensor):
            total += numel_besides(val, r.dim) * val.element_size()
    return total
