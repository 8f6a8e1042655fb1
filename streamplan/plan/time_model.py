"""A plan's time against stock's, from what the block computes (``graph.work.BlockWork``) and the device's rates:
the planner compares legal plans by it and every plan carries its ratio (``Plan.predicted_time_ratio``).

Streaming changes a block's time in a few ways, each priced here from the graph: GEMMs on a chunk's rows run below
the rate of GEMMs on every row (an efficiency curve in the rows); every chunk runs its ops again (launches and
dispatch that do not hide under short kernels); static rows (text beside image rows) are recomputed per chunk; ops
both phases run (a fused projection feeding K/V and Q) run twice per row; head groups (L3) run phase KV once per
group; attention calls over fewer rows or heads leave waves part empty; a K/V store (L4) adds its copies out and
back (the share of them the attention does not hide), its log-sum-exp merges and a fixed cost per block call
(``store_seconds``). The constants are fitted to a GPU sweep of forced plans (``benchmarks/gpu_time_model.py``,
docs/budgets-and-tiers.md "The time model")."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """What the device does per second, fitted on the benchmark device (docs/budgets-and-tiers.md)."""

    gemm: float            # FLOP/s of a bf16 GEMM over many rows
    gemm_half_rows: float  # rows at which a GEMM runs at half that rate (efficiency m / (m + half))
    attention: float       # FLOP/s of the fused attention
    bandwidth: float       # bytes/s the element-wise ops reach
    op_s: float            # seconds an op adds per chunk beyond its kernel (launch, dispatch, a short kernel's tail)
    group_rerun: float     # share of phase KV's work each extra head group adds (its chain rerun, narrower GEMMs)
    # a K/V store (``store_seconds``): its copies at ``host_bandwidth`` each way, those back hidden under up to
    # ``store_hidden`` of the attention's time yet at least ``store_unhidden`` of them showing, ``store_share`` of
    # the copies' seconds showing in all; the merges' bytes at ``merge_bandwidth``; ``block_step_s`` per block step
    # and ``group_step_s`` per pass and head group beyond the first (a pass read back a group at a time: its Q
    # sliced, its accumulator, output and phase KV's write pieces per group)
    host_bandwidth: float = 54e9
    store_hidden: float = 0.75
    store_unhidden: float = 0.3
    store_share: float = 1.0
    merge_bandwidth: float = 3.0e12
    block_step_s: float = 1.5e-4
    group_step_s: float = 1.5e-4
    # chunk replay (``execute.chunk_replay``): the share of ``op_s`` an op costs in a replayed chunk, and the chunks'
    # worth of ``op_s`` a phase's recording costs (its eager warm-up and capture). None: not fitted on this device,
    # so the planner does not weigh replay on its own there (``replay=True`` still replays, priced as eager chunks)
    replay_op: float | None = None
    replay_setup: float = 2.0


# fitted on the benchmark device's sweep (docs/budgets-and-tiers.md, "The time model"); "meta" plans as for that
# device, so `streamplan plan` shows what the benchmarks ran. The store's constants come from a store sweep and the
# planner's own store plans on another GPU of like compute, and ``op_s`` from a sweep of row chunks there after the
# host-cost cut (which, when, and how alike: the same section of the docs)
H200 = Rates(gemm=1.035e15, gemm_half_rows=0.0, attention=5.63e14, bandwidth=1.32e12, op_s=6.43e-6, group_rerun=2.38,
             store_hidden=1.0, store_unhidden=0.0, store_share=0.598, merge_bandwidth=float("inf"),
             block_step_s=1.04e-4, group_step_s=1.448e-3)
RATES = {"cuda": H200, "meta": H200}


def rates_for(device_type: str) -> Rates | None:
    """The rates the model prices plans with on this device; None where none were fitted (the CPU: plans are then
    chosen by memory alone, with no predicted time)."""
    return RATES.get(device_type)


def _gemm_s(flops: float, rows: int, r: Rates) -> float:
    return flops / (r.gemm * rows / (rows + r.gemm_half_rows)) if flops else 0.0


def stock_seconds(w, r: Rates) -> float:
    """One stock call: every GEMM over every row, the attentions, the element-wise traffic."""
    n = w.rows
    return (_gemm_s(w.gemm_flops_row * n + w.gemm_flops_static, n, r) + w.gemm_flops_const / r.gemm
            + (w.attention_flops + w.attention_flops_row * n) / r.attention + w.bytes_row * n / r.bandwidth
            + (w.ops_kv + w.ops_q) * r.op_s)


@dataclass(frozen=True)
class Streamed:
    """What of a plan the time model reads."""

    chunk: int
    slices: int = 1          # MLP slices per chunk (L2)
    groups: int = 1          # head groups (L3)
    wave_waste: float = 0.0  # share of the attention's time its chunked calls leave in part-empty waves
    store_s: float = 0.0     # a K/V store's extra seconds (copies, merges), priced by the planner
    pieces: int = 1          # row pieces of a chunk its row-local runs run in (1: whole)
    replayed: bool = False   # chunks after the first two replayed as one recording (``execute.chunk_replay``)
    staged: int = 0          # bytes the replay's staging copies (each chunk's rows in and out)
    store_steps_s: float = 0.0  # of ``store_s``: the store's block and group steps (``store_step_seconds``)


def streamed_seconds(w, r: Rates, s: Streamed) -> float:
    """One streamed call under ``s``: stock's work at the chunk's GEMM efficiency, plus what chunking adds."""
    n = w.rows
    c = max(1, min(s.chunk, n))
    k = -(-n // c)
    gemm = _gemm_s(w.gemm_flops_row * n + k * w.gemm_flops_static + w.rerun_flops_row * n, c, r)
    gemm += w.gemm_flops_const / r.gemm
    memory = (w.bytes_row + w.rerun_bytes_row) * n / r.bandwidth
    attention = ((w.attention_flops + w.attention_rerun_flops) * (1 + s.wave_waste) + w.attention_flops_row * n) \
        / r.attention
    groups = (s.groups - 1) * r.group_rerun * (_gemm_s(w.kv_flops_row * n, c, r) + w.kv_bytes_row * n / r.bandwidth)
    memory += s.staged / r.bandwidth
    return gemm + memory + attention + groups + _ops_seconds(w, r, s, k) + pieces_seconds(w, r, s.pieces, k) \
        + s.store_s


def _ops_seconds(w, r: Rates, s: Streamed, k: int) -> float:
    """Every chunk's ops run again: their launches and dispatch, beyond their kernels (``k`` chunks)."""
    per_chunk = (w.ops_kv * s.groups + w.ops_q + (s.slices - 1) * w.ops_mlp) * r.op_s
    if s.replayed and k > 2 and r.replay_op is not None:   # two chunks eager, the recording, the rest replayed
        return (2 + r.replay_setup + (k - 2) * r.replay_op) * per_chunk
    return k * per_chunk


def host_seconds(w, r: Rates, s: Streamed) -> float:
    """Of ``streamed_seconds``, what is the host dispatching (each chunk's ops, row pieces' launches, a store's block
    and group steps): the part a slower host CPU stretches. Lent GPUs of one kind differ in it, so a plan that is
    mostly this takes another time on another host (docs/budgets-and-tiers.md, the time model)."""
    k = -(-w.rows // max(1, min(s.chunk, w.rows)))
    return _ops_seconds(w, r, s, k) + _pieces_ops(w, r, s.pieces, k) + s.store_steps_s


def _pieces_ops(w, r: Rates, pieces: int, chunks: int) -> float:
    return chunks * ((pieces - 1) * w.ops_runs + pieces * w.ops_piece) * r.op_s if pieces > 1 else 0.0


def pieces_seconds(w, r: Rates, pieces: int, chunks: int) -> float:
    """What row pieces add: each piece launches its runs' ops again, narrows its inputs and copies its outputs into
    the chunk's buffers (those bytes written once more). Pieces also turn fused chains off (``GraphRun``); the fit
    has no term for fused chains (their gain is inside the fitted rates), so that loss is not priced here."""
    if pieces <= 1:
        return 0.0
    return _pieces_ops(w, r, pieces, chunks) + w.runs_bytes_row * w.rows / r.bandwidth


@dataclass(frozen=True)
class StoreTraffic:
    """What a K/V store moves and does in one call (from the planner's store model, ``planner.store_traffic``)."""

    out_bytes: int        # K/V copied out to the host once, in phase KV
    back_bytes: int       # K/V copied back over every pass of phase Q
    merge_bytes: float    # the log-sum-exp merges' reads and writes of their fp32 accumulators
    calls: float          # block steps: passes x blocks read (each of them ``groups`` calls, one per head group)
    groups: int           # head groups the store is read back in
    passes: int           # passes over the store (Q spans or chunks)
    attention_s: float    # the attention's seconds the copies back may hide under


def store_copies(t: StoreTraffic, r: Rates) -> float:
    """The copies' seconds that show before ``store_share``: all of those out (phase KV's side stream shares the
    bandwidth with its projections), of those back what the attention does not hide, at least ``store_unhidden``."""
    back = t.back_bytes / r.host_bandwidth
    return t.out_bytes / r.host_bandwidth + max(back - r.store_hidden * t.attention_s, r.store_unhidden * back)


def store_seconds(t: StoreTraffic, r: Rates) -> float:
    """A store's seconds on top of the streamed call's compute: its copies, merges and block calls."""
    return r.store_share * store_copies(t, r) + t.merge_bytes / r.merge_bandwidth + store_step_seconds(t, r)


def store_step_seconds(t: StoreTraffic, r: Rates) -> float:
    """A store's block steps and its passes' extra head groups: host time per step, whatever the bytes."""
    return t.calls * r.block_step_s + t.passes * (t.groups - 1) * r.group_step_s


def time_ratio(w, r: Rates, s: Streamed) -> float:
    """``streamed_seconds`` over ``stock_seconds``: what ``Plan.predicted_time_ratio`` holds."""
    return streamed_seconds(w, r, s) / stock_seconds(w, r)
