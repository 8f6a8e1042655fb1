"""Chunks replayed: a phase's chunks of one size run as recorded CUDA graphs after the first two. Why: at short
lengths under a tight budget a chunk is a few hundred rows, and each of its ~100 ops costs ~10 us of dispatch and
launch that its kernels no longer hide (docs/budgets-and-tiers.md, the time model); a recording replays them in one
launch. The same kernels run on the same values, so the outputs are the eager chunks' bit for bit.

A chunk's schedule is cut at its global attentions: the runs between them are recorded, and each attention runs eager
between their replays, for the chunk it is (a causal attention's keys, a row mask's part, depend on where the chunk
starts; the attention kernels are never recorded). A recording reads and writes fixed addresses, so the chunk's rows
are copied into staging buffers before its replays, each attention's output into a buffer the next run reads, and the
outputs, which the recording writes into its own memory, are copied out after (the planner prices all of them:
``Plan.replay``, ``staged_row_bytes``). The first chunk runs eager (it lays out the whole buffers and checks fused
chains); the second runs eager on the recording stream (lazy initialisation happens outside a recording) and is then
recorded; the rest replay; a last chunk of another size runs eager. A recording that fails leaves the call's other
chunks eager, and the report says why.

Off CUDA (and in a rehearsal, on fake tensors) ``RerunRecorder`` runs the recorded runs again through the same
staging: the memory the staging holds is the recording's, and the staging is checked on the CPU."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ..graph.analyze import Rows, numel_besides

log = logging.getLogger(__name__)

# devices whose plans the planner may replay on its own: CUDA, and meta planned as the benchmark device
RECORDS = ("cuda", "meta")
# cuBLAS gives each stream a GEMM runs on a workspace of its own, from the caching allocator, and keeps it for the
# stream's life: 32 MiB on an H100 with torch 2.11 (measured: a bf16 matmul on a new stream allocated its output
# + 32 MiB). Recording runs on one stream per device for the process (``recording_stream``), so that workspace is
# made once, at the first replayed call, which the planner prices with every replayed plan (``replay_held_bytes``).
DEFAULT_CUBLAS_WORKSPACE = 32 << 20
_STREAMS: dict[torch.device, Any] = {}


def recording_stream(device: torch.device):
    """The one side stream replays record on for ``device``: a new stream per call would take a new one of torch's
    pooled streams each time, each with a workspace of its own (32 of them in turn: 1 GiB on an H100)."""
    key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key)
    return _STREAMS[key]


def replay_held_bytes(device: torch.device) -> int:
    """Device bytes a replayed call may hold besides its staging: the recording stream's cuBLAS workspace where graphs
    are recorded (CUDA, meta planned as the benchmark GPU); its size from ``CUBLAS_WORKSPACE_CONFIG``
    (``:KiB:count``, repeated) where set."""
    if device.type not in RECORDS:
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    parts = [int(v) for v in config.split(":") if v.isdigit()]
    if parts and len(parts) % 2 == 0:
        return sum(kib * count for kib, count in zip(parts[::2], parts[1::2])) << 10
    return DEFAULT_CUBLAS_WORKSPACE

Env = dict[fx.Node, Any]


@dataclass
class ChunkProgram:
    """One chunk's schedule cut for replay: ``runs[i]`` recorded, ``breaks[i]`` (an attention step) eager after it;
    ``run(steps, env)`` runs steps on an environment, ``brk(step, env)`` runs one break (setting its value, letting go
    what it read last), ``drop(step, env)`` lets go what a break reads last without running it, ``reads(step)`` the
    values a break reads."""

    runs: list[list]
    breaks: list
    run: Callable[[list, Env], None]
    brk: Callable[[Any, Env], None]
    drop: Callable[[Any, Env], None]
    reads: Callable[[Any], list[fx.Node]]
    outputs: tuple


class RerunRecorder:
    """Records a run by keeping it; replays it by running it again (its last values let go first, as a recording
    writes over its last replay's: the memory a replay holds is the recording's)."""

    def __init__(self, device: torch.device):
        self.runs: dict[int, tuple[Callable[[Env], None], Env, set]] = {}
        self.failed = ""

    def warm(self, fn: Callable[[], Env]) -> Env:
        return fn()

    def record(self, i: int, fn: Callable[[Env], None], env: Env) -> None:
        before = dict(env)
        fn(env)
        self.runs[i] = (fn, env, {k for k, v in env.items() if before.get(k) is not v})

    def replay(self, i: int) -> None:
        fn, env, made = self.runs[i]
        for node in made:   # a recording writes over what its last replay made
            env.pop(node, None)
        fn(env)

    def close(self) -> None:
        self.runs.clear()


class CudaGraphRecorder:
    """CUDA graphs of a chunk's runs, on one memory pool (replayed in the order recorded), recorded on a side stream
    after one eager chunk there."""

    def __init__(self, device: torch.device):
        self.stream = recording_stream(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.failed = ""   # why a recording failed (the warm-up's values stand)

    def warm(self, fn: Callable[[], Env]) -> Env:
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            values = fn()   # lazy initialisation (cuBLAS workspaces, compiled chains) happens here, not recording
        current.wait_stream(self.stream)
        for value in values.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(current)
        return values

    def record(self, i: int, fn: Callable[[Env], None], env: Env) -> None:
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        # ``capture_begin`` directly: ``torch.cuda.graph`` would synchronise and empty the allocator's cache first,
        # at every recording of every block's call
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn(env)
            finally:
                graph.capture_end()
        self.graphs[i] = graph

    def replay(self, i: int) -> None:
        self.graphs[i].replay()

    def close(self) -> None:
        self.graphs.clear()   # their pool goes with them


def recorder_for(device: torch.device, fake: bool) -> type:
    return CudaGraphRecorder if device.type == "cuda" and not fake else RerunRecorder


class ChunkReplay:
    """One phase's replay: the staged inputs, the recorder, each break's buffer, and what went wrong (``problem``)."""

    def __init__(self, device: torch.device, staged: list[fx.Node], size: int, fake: bool = False):
        self.recorder = recorder_for(device, fake)(device)
        self.staged = tuple(staged)
        self.size = size            # the chunk rows the recording holds for
        self.static: Env = {}       # staged inputs, then each break's output buffer
        self.eager_chunks = 1       # the first chunk lays out the buffers: eager
        self.problem = ""           # why recording failed (the call's other chunks ran eager)
        self.env: Env = {}          # the recording's environment: its outputs, refilled by each replay
        self.reads: list[Env] = []  # what each break reads, as the recording left it

    def takes(self, a: int, b: int) -> bool:
        if self.problem or b - a != self.size:
            return False
        if self.eager_chunks:
            self.eager_chunks -= 1
            return False
        return True

    def run(self, env: Env, prog: ChunkProgram) -> Env:
        """One chunk: ``env`` its inputs; its outputs, eager (the chunk recorded) or the recording's after a replay."""
        if not self.env:
            return self._record(env, prog)
        for node in self.staged:
            self.static[node].copy_(env[node])
        for i, steps in enumerate(prog.runs):
            if i:   # the last attention's buffer, as the recording read it (a re-run recorder reads its environment)
                node = prog.breaks[i - 1].node
                self.env[node] = self.static[node]
            if steps:
                self.recorder.replay(i)
            if i < len(prog.breaks):
                step = prog.breaks[i]
                # what it reads: the recording's values, refilled (a re-run recorder's are in its environment anew)
                reads = {n: self.env.get(n, v) for n, v in self.reads[i].items()}
                prog.brk(step, reads)
                self.static[step.node].copy_(reads[step.node])
                del reads
        return {o: self.env[o] for o in prog.outputs if o in self.env}

    def _record(self, env: Env, prog: ChunkProgram) -> Env:
        for node in self.staged:
            value = env[node]
            self.static[node] = torch.empty_like(value, memory_format=torch.contiguous_format)
            self.static[node].copy_(value)
        staged = {**env, **self.static}

        def eager() -> Env:
            e = dict(staged)
            for i, steps in enumerate(prog.runs):
                prog.run(steps, e)
                if i < len(prog.breaks):
                    prog.brk(prog.breaks[i], e)
                    self.static[prog.breaks[i].node] = e[prog.breaks[i].node]   # its shape, for the buffer
            return {o: e[o] for o in prog.outputs if o in e}

        outs = self.recorder.warm(eager)
        for step in prog.breaks:   # each break's output buffer, beside the recording's memory
            self.static[step.node] = torch.empty_like(self.static[step.node])
        e = dict(staged)
        try:
            for i, steps in enumerate(prog.runs):
                if i:
                    e[prog.breaks[i - 1].node] = self.static[prog.breaks[i - 1].node]
                if steps:
                    self.recorder.record(i, lambda env, steps=steps: prog.run(steps, env), e)
                if i < len(prog.breaks):
                    self.reads.append({n: e[n] for n in prog.reads(prog.breaks[i]) if n in e})
                    prog.drop(prog.breaks[i], e)
        except Exception as err:   # noqa: BLE001 - an op that cannot be recorded: this call's chunks run eager
            self.recorder.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if self.recorder.failed:
            self.problem = self.recorder.failed
            log.info("chunk replay off for this call: %s", self.problem)
            self.close()
            return outs
        self.env = e
        return outs

    def close(self) -> None:
        self.recorder.close()
        self.static.clear()
        self.env, self.reads = {}, []


def replay_problem(an, parallel: bool, whole_q: bool) -> str:
    """Why a captured block's chunks cannot be replayed ('': they can): what runs between its attentions must be the
    same ops on the same shapes at fixed addresses for every chunk, reading nothing from where the chunk starts."""
    causes = [(an.reduced, "an attention reduced over the chunks (its merge carries from chunk to chunk)"),
              (an.halo != (0, 0), "convolutions along the rows (a chunk reads its neighbours' rows)"),
              (an.fixed_cuts, "rows cut at a fixed count (a chunk's side of the cut depends on where it starts)"),
              (an.input_writes, "in-place writes into the block's inputs"),
              (parallel, "sequence parallelism (exchanges between ranks)"),
              (whole_q, "a whole-Q attention (phase Q reads rows of its output)")]
    return next((why for cond, why in causes if cond), "")


def _row_bytes(node: fx.Node, r) -> int:
    val = node.meta.get("val")
    if isinstance(r, Rows) and isinstance(val, torch.Tensor):
        return numel_besides(val, r.dim) * val.element_size()
    return 0


def staged_row_bytes(an, graph: fx.Graph) -> int:
    """Device bytes per row a replayed chunk holds beyond an eager one: each input with rows copied in (the values
    read as inputs too), each output with rows copied out, and at each attention its Q (held for the eager call
    between recordings) and its output's buffer."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"] + list(an.read_as_inputs)
    nodes = [n for n in inputs if n not in an.whole_inputs] + [o for o in an.outputs if isinstance(o, fx.Node)]
    total = sum(_row_bytes(n, an.rows.get(n)) for n in dict.fromkeys(nodes))
    return total + sum(_row_bytes(att.q, att.q_rows) + _row_bytes(att.node, att.q_rows) for att in an.attentions)
