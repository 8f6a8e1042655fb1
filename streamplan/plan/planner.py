"""Choosing a tier and chunk sizes per operation from its spec, its runtime shape and a budget."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence
from enum import Enum

from .budget import fmt_bytes
from .time_model import (H200, Rates, StoreTraffic, Streamed, host_seconds, store_seconds, store_step_seconds,
                         streamed_seconds, time_ratio)
from ..specs import MLPSpec
from .weight_formats import can_slice_in, can_slice_out, slice_align

DEFAULT_CHUNK_TOKENS = 4096   # used when neither a budget nor a chunk is given
ROW_ALIGN = 256               # budget-chosen chunks are multiples of this (GEMM-friendly)
MIN_CHUNK_TOKENS = 256        # smallest row chunk the planner will choose on its own
# Rows per chunk below which GEMMs lose throughput (the projections of wide blocks fall well short of their best);
# calibrated on the benchmark device (docs/budgets-and-tiers.md, Calibration). The planner climbs the tier ladder
# before it goes below this; on CPU there is no such cliff worth a tier.
UTILISATION_FLOOR = {"cuda": 2048, "meta": 2048}   # planning on meta tensors is planning for a GPU
# Fused attention kernels run one block per (128 query rows, head): a chunk whose blocks fill whole waves of the
# GPU's multiprocessors wastes no partial wave, so planner-chosen chunks are rounded to whole waves (the gain is
# calibrated on the benchmark device: docs/budgets-and-tiers.md, Calibration).
ATTENTION_TILE_ROWS = 128


@dataclass(frozen=True)
class Waves:
    """How one chunk's attention blocks (``batch_heads`` per ``tile`` query rows) fill the device's multiprocessors;
    the default (nothing known) leaves chunks as the budget gives them."""

    multiprocessors: int = 0
    batch_heads: int = 0
    tile: int = ATTENTION_TILE_ROWS

    @property
    def quantum(self) -> int:
        """Smallest row count whose attention blocks fill whole waves."""
        import math
        if self.multiprocessors <= 0 or self.batch_heads <= 0:
            return 1
        return self.tile * self.multiprocessors // math.gcd(self.batch_heads, self.multiprocessors)

    def round(self, chunk: int, rows: int) -> int:
        """A planner-chosen chunk rounded down to whole waves when that keeps at least one quantum; below one
        quantum, the tile count (down to ``BELOW_QUANTUM_KEEP`` of it) whose last wave is fullest: 21 tiles x 56 heads
        fill 9 waves of 132 to 99%, 22 tiles fill 10 to 93% (the H3 block at 65,536 rows)."""
        q = self.quantum
        if q <= 1 or chunk >= rows:
            return chunk
        if chunk >= q:
            return chunk // q * q
        most = chunk // self.tile
        if most < 2:
            return chunk

        def per_tile(t: int) -> float:   # waves per tile: the time of a row, up to a constant
            return -(-t * self.batch_heads // self.multiprocessors) / t

        least = max(1, int(most * BELOW_QUANTUM_KEEP + 0.999))
        best = min(per_tile(t) for t in range(least, most + 1))
        # the most tiles within 1% of the best: fewer rows per chunk cost per-chunk work the waves do not show
        return max(t for t in range(least, most + 1) if per_tile(t) <= best * 1.01) * self.tile


BELOW_QUANTUM_KEEP = 0.85
# planning on meta tensors is planning for the benchmark device whose rates the constants here are calibrated on
# (docs/budgets-and-tiers.md, Calibration): its multiprocessors
META_MULTIPROCESSORS = 132


def aligned_chunk(chunk: int, align: int) -> int:
    """``chunk`` rounded down to whole units of ``align`` rows (at least one): every chunk then starts where the
    attention's consumer asks (a flex mask's query blocks), so it takes its blocks' rows of the mask as they are."""
    return chunk if align <= 1 else max(align, chunk // align * align)


def wave_waste(waves: Waves, rows: int, groups: int = 1) -> float:
    """Time lost to the last partial wave of one attention call over ``rows`` query rows and a ``groups``-th of the
    heads, as a share of its work (0: nothing known, or whole waves)."""
    heads = waves.batch_heads // max(1, groups)
    if waves.multiprocessors <= 0 or heads <= 0 or rows <= 0:
        return 0.0
    tiles = -(-rows // waves.tile) * heads
    return -(-tiles // waves.multiprocessors) * waves.multiprocessors / tiles - 1.0


MIN_FFN_SLICE = 256
# Stock is kept only with this much room to spare: its estimate misses allocator fragmentation (memory reserved but
# unallocated) and libraries' temporaries, and being wrong there is an out-of-memory, not a slower run; calibrated on
# the benchmark device (docs/budgets-and-tiers.md, Calibration).
STOCK_MARGIN = 0.15


def stock_fits(stock: int, budget: int) -> bool:
    return stock * (1 + STOCK_MARGIN) <= budget


class Tier(str, Enum):
    """The tier ladder (docs/design.md, The tier ladder); a str, so plans compare, print and serialise as "L1"."""

    L0 = "L0"   # stock: the module's own forward
    L1 = "L1"   # row-streamed
    L2 = "L2"   # + feature-sliced MLP
    L3 = "L3"   # + head-grouped K/V
    L4 = "L4"   # host-staged K/V: exact, read back in blocks merged by log-sum-exp
    L5 = "L5"   # approximate K/V stores (int8, fp8): opt-in only
    L6 = "L6"   # a model forward's hidden state in host memory between blocks, read back chunk by chunk

    def __str__(self) -> str:
        return self.value

    @property
    def meaning(self) -> str:
        """What the code means, in the report's legend."""
        return TIER_MEANING[self]

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


TIER_MEANING = {
    Tier.L0: "stock (the module's own forward)",
    Tier.L1: "row chunks",
    Tier.L2: "row chunks, the MLP a slice of its hidden features at a time",
    Tier.L3: "row chunks, K/V built a group of heads at a time",
    Tier.L4: "K/V staged in host memory (exact)",
    Tier.L5: "K/V compressed (int8/fp8: approximate, opt-in)",
    Tier.L6: "the model's hidden state in host memory between blocks",
}


class BudgetError(ValueError):
    """Nothing the planner can build fits the budget; raised before any work runs.

    ``least``: the smallest peak (bytes) the planner reaches for the refused operation, where it knows one.
    ``smallest_bytes``: the smallest byte budget (``budget=``) that runs the refused operation, its live inputs
    included, set where streamplan knows it (``apply``'s handle fills it in from ``least``); None elsewhere."""

    def __init__(self, message: str, least: int | None = None, smallest_bytes: int | None = None):
        super().__init__(message)
        self.least, self.smallest_bytes = least, smallest_bytes

    def __reduce__(self):
        return type(self), (str(self), self.least, self.smallest_bytes)


class HostMemoryError(BudgetError):
    """A plan that keeps rows in host memory (L6) needs more host memory than can be had; raised before the forward
    runs where it is known then. ``needed`` and ``available`` in bytes (``available`` None where unknown)."""

    def __init__(self, message: str, needed: int = 0, available: int | None = None):
        super().__init__(message)
        self.needed, self.available = needed, available

    def __reduce__(self):
        return type(self), (str(self), self.needed, self.available)


# tiers whose plan's ``ffn_slice`` slices the MLP (L1's is the whole MLP; L4/L5 plans may slice it to fit their chunk)
SLICED_TIERS = (Tier.L2, Tier.L3, Tier.L4, Tier.L5)


@dataclass
class PeakParts:
    """What a plan's predicted peak is made of, in bytes above the call's inputs (``StreamHandle.timeline`` draws
    them): where the memory goes at the call's worst moment."""

    kv: int = 0          # K and V kept on the device between the phases: whole, one head group's, or a store's rows
                         # and the block it reads back
    held: int = 0        # other buffers built whole: the outputs (the residual stream's next value), an attention
                         # output built ahead (L3), a whole Q
    transient: int = 0   # one chunk's values at their worst moment (its phase's projections, MLP, attention)


def peak_parts(peak: int, kv: int, held: int) -> PeakParts:
    """A streamed plan's peak as K/V, other whole buffers and the chunk's transient (what is left of it)."""
    kv, held = max(0, kv), max(0, held)
    return PeakParts(kv, held, max(0, peak - kv - held))


@dataclass
class Plan:
    """One operation's schedule for one input signature: data, printable, serialisable."""

    tier: Tier           # L0 stock, L1 row-streamed, L2 + feature-sliced MLP, L3 + head-grouped K/V
    rows: int
    chunk: int           # rows per chunk (== rows for L0)
    ffn_slice: int       # MLP hidden features per slice (== ffn unless L2; 0 for attention)
    predicted_peak: int  # bytes above the inputs, outputs included
    stock_peak: int
    note: str = ""       # what a model-level plan does (its blocks carry their own plans)
    head_groups: int = 1  # L3: K/V built and attended for kv_heads / head_groups heads at a time
    live_bytes: int = 0  # the call's inputs, alive throughout (a whole model's peak adds them)
    budget: int | None = None  # what this operation was allowed (the budget less the live inputs)
    kv: str = "device"   # where K/V live between the phases: device, host (L4), int8 or fp8 (L5)
    kv_block: int = 0    # L4/L5: K/V rows read back per block in phase Q
    host_traffic: int = 0  # L4: bytes moved between host and device per call (K/V out once, back once per Q pass)
    q: str = "chunks"    # "whole": Q built chunk by chunk into one buffer, attended in one call (a consumer that
                         # needs every query row at once), the rest of the block streamed over the attention's output
    q_span: int = 0      # L4/L5: query rows attended per pass over the store (several chunks' Q built into one buffer,
                         # the rest of the block run over rows of its output); 0: each chunk's Q alone
    host_bytes: int = 0  # host memory the plan needs at once (L4's K/V stores, L6's rows), pinned on CUDA
    kv_kept: int = 0     # L4: a host store's first rows kept on the device (the budget's room beyond the plan), read
                         # back by no pass
    parts: PeakParts | None = None   # what ``predicted_peak`` is made of, where the planner's model says
    predicted_time_ratio: float | None = None   # the time model's call time against stock's (None: not modelled
    # on this device or for this operation)
    predicted_host_share: float | None = None   # of that time, the share that is the host dispatching (chunk ops, a
    # store's block steps): what a slower host CPU stretches (``time_model.host_seconds``)
    row_pieces: int = 1  # a captured block's row-local runs (norms, rotary, modulation) in this many pieces of a
    # chunk's rows: their temporaries a piece's, not the chunk's (1: whole chunks)
    kept_outputs: bool = False   # attentions a later attention's phase KV runs: their outputs kept whole there for
    # phase Q to read rather than attended again (``graph.phases.rerun_attentions``)
    replay: bool = False   # a captured block's chunks of one size, after the first two, replayed as CUDA graphs
    # recorded around its attentions (``execute.chunk_replay``): their rows staged in and out, priced in the peak

    @property
    def predicted_total(self) -> int:
        return self.live_bytes + self.predicted_peak

    def to_dict(self) -> dict:
        return {**asdict(self), "tier": str(self.tier)}

    def describe(self, figures: bool = True) -> str:
        """The schedule in one line; ``figures=False`` leaves out the peaks (the report shows them in its table, on
        one baseline: the call's inputs included)."""
        if self.note:
            return f"{self.tier} {self.note}"
        if self.tier == Tier.L0:
            return f"L0 stock  rows={self.rows}" + (f"  peak~{fmt_bytes(self.predicted_peak)} above its inputs"
                                                    if figures else "")
        sl = f"  ffn_slice={self.ffn_slice}" if self.ffn_slice and self.tier in SLICED_TIERS else ""
        hg = f"  head_groups={self.head_groups}" if self.head_groups > 1 else ""
        hg += f"  row_pieces={self.row_pieces}" if self.row_pieces > 1 else ""
        hg += "  kept_outputs" if self.kept_outputs else ""
        hg += "  replayed" if self.replay else ""
        kv = "  q=whole (one attention call)" if self.q == "whole" else ""
        if self.kv != "device":
            kv += f"  kv={self.kv} block={self.kv_block}"
            kv += f" kept={self.kv_kept}" if self.kv_kept else ""
            kv += f" q_span={self.q_span}" if self.q_span > self.chunk else ""
            kv += f" host traffic~{fmt_bytes(self.host_traffic)}" if self.host_traffic else ""
            kv += " (approximate)" if self.tier == Tier.L5 else ""
        if not figures:
            return f"{self.tier} rows={self.rows} chunk={self.chunk}{sl}{hg}{kv}"
        return (f"{self.tier} rows={self.rows} chunk={self.chunk}{sl}{hg}{kv}  peak~{fmt_bytes(self.predicted_peak)}"
                f" above its inputs (stock {fmt_bytes(self.stock_peak)})")


def mlp_row_elems(spec: MLPSpec, width: int) -> int:
    """Elements per row alive at the worst moment when ``width`` hidden features are built at once."""
    if spec.layout == "plain":            # proj, act(proj)
        build = 2 * width
    elif spec.layout == "gated-fused":    # [up|gate], act(gate), up*act
        build = 4 * width
    else:                                 # act(gate) while up and the product exist
        build = 3 * width
    return max(build, width + spec.dim_out)


def mlp_peak(spec: MLPSpec, rows: int, elem: int, tier: Tier, chunk: int, ffn_slice: int) -> int:
    if tier == Tier.L0:
        return rows * mlp_row_elems(spec, spec.ffn) * elem
    out = rows * spec.dim_out * elem
    if tier == Tier.L1:   # the stock forward on one chunk, its result copied into the output
        return out + min(chunk, rows) * mlp_row_elems(spec, spec.ffn) * elem
    return out + min(chunk, rows) * (mlp_row_elems(spec, ffn_slice) - spec.dim_out) * elem


def can_feature_slice(spec: MLPSpec) -> bool:
    return can_slice_out(spec.in_proj, *( [spec.gate_proj] if spec.gate_proj is not None else [])) and \
        can_slice_in(spec.out_proj)


def plan_mlp(spec: MLPSpec, rows: int, elem: int, *, chunk_tokens: int | None = None,
             ffn_slice: int | None = None, budget: int | None = None) -> Plan:
    stock = mlp_peak(spec, rows, elem, Tier.L0, rows, spec.ffn)

    def make(tier: Tier, chunk: int, sl: int) -> Plan:
        chunk = min(chunk, rows)
        peak = mlp_peak(spec, rows, elem, tier, chunk, sl)
        return Plan(tier, rows, chunk, sl, peak, stock,
                    parts=None if tier == Tier.L0 else peak_parts(peak, 0, rows * spec.dim_out * elem))

    if ffn_slice is not None and can_feature_slice(spec):
        sl = _align_slice(min(ffn_slice, spec.ffn), spec)
        return make(Tier.L2, chunk_tokens or rows, sl)
    if chunk_tokens is not None or budget is None:
        return _fixed(rows, chunk_tokens, lambda tier, c: make(tier, c, spec.ffn))
    if stock_fits(stock, budget):
        return make(Tier.L0, rows, spec.ffn)
    chunk = _largest_chunk(lambda c: mlp_peak(spec, rows, elem, Tier.L1, c, spec.ffn), rows, budget)
    if chunk is not None:
        return make(Tier.L1, chunk, spec.ffn)
    if can_feature_slice(spec):
        for sl in _slice_candidates(spec):
            chunk = _largest_chunk(lambda c: mlp_peak(spec, rows, elem, Tier.L2, c, sl), rows, budget)
            if chunk is not None:
                return make(Tier.L2, chunk, sl)
    # the smallest peak the search above reaches: one floor-sized chunk, whole or at the narrowest slice it tries
    slices = _slice_candidates(spec) if can_feature_slice(spec) else []
    floor = min([mlp_peak(spec, rows, elem, Tier.L1, MIN_CHUNK_TOKENS, spec.ffn)]
                + [mlp_peak(spec, rows, elem, Tier.L2, MIN_CHUNK_TOKENS, sl) for sl in slices[-1:]])
    raise BudgetError(f"{spec.label}: budget {fmt_bytes(budget)} is below the smallest peak streamplan can reach "
                      f"for {rows} rows ({fmt_bytes(floor)}, dominated by the {rows}x{spec.dim_out} output)",
                      least=floor)


def _fixed(rows: int, chunk_tokens: int | None, make, align: int = 1) -> Plan:
    """A forced chunk, or with no budget the default one: stream only inputs longer than it."""
    chunk = chunk_tokens or DEFAULT_CHUNK_TOKENS
    chunk = max(align, chunk // align * align)
    return make(Tier.L1, chunk) if rows > chunk else make(Tier.L0, rows)


def _largest_chunk(peak_of, rows: int, budget: int, floor: int = MIN_CHUNK_TOKENS) -> int | None:
    if peak_of(rows) <= budget:
        return rows
    lo, hi = min(floor, rows), rows
    if peak_of(lo) > budget:
        return None
    while hi - lo > ROW_ALIGN:
        mid = (lo + hi) // 2 // ROW_ALIGN * ROW_ALIGN
        if mid <= lo:
            break
        lo, hi = (mid, hi) if peak_of(mid) <= budget else (lo, mid)
    return lo


def _align_slice(sl: int, spec: MLPSpec) -> int:
    align = slice_align(*spec.projections())
    return max(align, sl // align * align)


def _slice_candidates(spec: MLPSpec) -> list[int]:
    out, sl = [], spec.ffn // 2
    while sl >= MIN_FFN_SLICE:
        out.append(_align_slice(sl, spec))
        sl //= 2
    return out


@dataclass(frozen=True)
class AttentionDims:
    batch: int
    rows: int        # query rows (all segments)
    kv_rows: int     # key rows (== rows for self-attention)
    heads: int
    kv_heads: int
    head_dim: int
    dim_out: int
    elem: int
    mask_row_bytes: int = 0  # bytes of mask built per query row of a chunk (causal or prepared masks)
    # a value built once from every row after K and V are whole (a mask chosen from the call's Q and K): what it keeps
    # through the attention, its build's transients (stock's call has both too) and the inputs only the streamed call
    # holds for it (Q of every row, beside K and V, until it is built)
    built_held: int = 0
    built_transient: int = 0
    built_inputs: int = 0


def attention_peak(d: AttentionDims, tier: Tier, chunk: int, groups: int = 1) -> int:
    e, B, c = d.elem, d.batch, min(chunk, d.rows) if tier != Tier.L0 else d.rows
    q_row, kv_row = d.heads * d.head_dim, d.kv_heads * d.head_dim
    kv = 2 * B * d.kv_rows * kv_row * e // groups
    if groups > 1:
        kv += B * d.rows * q_row * e
    mask = c * d.mask_row_bytes
    if tier == Tier.L0:  # q, k, v, the attention output and its reshaped copy, then the projection
        return kv + B * d.rows * (q_row * 3 + d.dim_out) * e + mask + d.built_held + d.built_transient
    out = B * d.rows * d.dim_out * e
    phase_kv = B * c * kv_row * 4 * e                               # k, v of a chunk and their norm/rotary copies
    phase_q = B * c * (q_row * 3 + d.dim_out) * e + mask            # q (+rotary), o, o reshaped, y
    return kv + out + d.built_held + max(phase_kv, phase_q, d.built_inputs + d.built_transient)


def plan_attention(d: AttentionDims, *, chunk_tokens: int | None = None, budget: int | None = None,
                   q_align: int = 1, head_groups: int | None = None, can_group: bool = True,
                   min_chunk: int = MIN_CHUNK_TOKENS) -> Plan:
    stock = attention_peak(d, Tier.L0, d.rows)

    def make(tier: Tier, chunk: int, groups: int = 1) -> Plan:
        chunk = min(chunk, d.rows)
        peak = attention_peak(d, tier, chunk, groups)
        kv = 2 * d.batch * d.kv_rows * d.kv_heads * d.head_dim * d.elem // groups
        held = d.batch * d.rows * (d.dim_out + (d.heads * d.head_dim if groups > 1 else 0)) * d.elem
        return Plan(tier, d.rows, chunk, 0, peak, stock, head_groups=groups,
                    parts=None if tier == Tier.L0 else peak_parts(peak, kv, held))

    if head_groups is not None and head_groups > 1 and can_group and d.kv_heads % head_groups == 0:
        return make(Tier.L3, chunk_tokens or DEFAULT_CHUNK_TOKENS, head_groups)

    if chunk_tokens is not None or budget is None:
        return _fixed(d.rows, chunk_tokens, make, q_align)
    if stock_fits(stock, budget):
        return make(Tier.L0, d.rows)
    chunk = None
    for floor in dict.fromkeys((max(min_chunk, MIN_CHUNK_TOKENS), MIN_CHUNK_TOKENS)):
        chunk = _largest_chunk(lambda c: attention_peak(d, Tier.L1, c), d.rows, budget, floor)
        if chunk is not None:
            break
        for groups in (head_group_options(d) if can_group else []):
            chunk = _largest_chunk(lambda c: attention_peak(d, Tier.L3, c, groups), d.rows, budget, floor)
            if chunk is not None:
                return make(Tier.L3, max(q_align, chunk // q_align * q_align), groups)
    if chunk is None:
        floor = attention_peak(d, Tier.L1, MIN_CHUNK_TOKENS)
        raise BudgetError(f"attention over {d.rows} rows: budget {fmt_bytes(budget)} is below the smallest peak "
                          f"streamplan can reach ({fmt_bytes(floor)}, dominated by the global K and V: "
                          f"{fmt_bytes(2 * d.batch * d.kv_rows * d.kv_heads * d.head_dim * d.elem)})", least=floor)
    return make(Tier.L1, max(q_align, chunk // q_align * q_align))


def head_group_options(d: AttentionDims) -> list[int]:
    """Numbers of head groups L3 may use: divisors of the K/V heads, above one."""
    return [g for g in range(2, d.kv_heads + 1) if d.kv_heads % g == 0]


def plan_rows(rows: int, row_bytes: int, transient_per_elem: int, *, chunk_tokens: int | None = None,
              budget: int | None = None) -> Plan:
    """A row-local module: stock holds ``transient_per_elem`` copies of its input; streamed, the output plus that
    many copies of one chunk."""
    stock = rows * row_bytes * transient_per_elem

    def make(tier: Tier, chunk: int) -> Plan:
        chunk = min(chunk, rows)
        peak = stock if tier == Tier.L0 else rows * row_bytes + chunk * row_bytes * transient_per_elem
        return Plan(tier, rows, chunk, 0, peak, stock,
                    parts=None if tier == Tier.L0 else peak_parts(peak, 0, rows * row_bytes))

    if chunk_tokens is not None or budget is None:
        return _fixed(rows, chunk_tokens, make)
    if stock_fits(stock, budget):
        return make(Tier.L0, rows)
    chunk = _largest_chunk(lambda c: rows * row_bytes + c * row_bytes * transient_per_elem, rows, budget)
    if chunk is None:
        raise BudgetError(f"row-local module over {rows} rows: budget {fmt_bytes(budget)} is below its output "
                          f"({fmt_bytes(rows * row_bytes)}) plus one chunk",
                          least=rows * row_bytes + min(rows, MIN_CHUNK_TOKENS) * row_bytes * transient_per_elem)
    return make(Tier.L1, chunk)


# L4/L5: K/V read back in blocks of these many rows (of one head group; the largest that fits beside the Q chunk);
# the first, past any sequence, is one block of every row: a head group's keys in one call, nothing to merge (each
# query row's output is its kernel's own, as on the device)
KV_BLOCKS = (1 << 40, 65536, 32768, 16384, 8192, 4096, 2048, 1024, 512, 256)
DEFAULT_KV_BLOCK = 8192
# Below the floor the planner weighs L3 against L4 by estimated extra time (seconds, from the shapes): a store's
# copies, merges and block calls by the device's fitted rates (``time_model.store_seconds``); the attention's
# seconds, where its time is not known, at this rate (FLOP/s of bf16 fused attention, docs/budgets-and-tiers.md,
# Calibration)
ATTENTION_RATE = {"cuda": 5.5e14, "meta": 5.5e14}
# what one more row chunk costs beside the copies (its ~100 kernels' launches and tails, GEMMs on fewer rows): an
# estimate calibrated on the benchmark device from where a block's time went (docs/budgets-and-tiers.md,
# Calibration); it keeps Q spans from buying small chunks
CHUNK_STEP_S = 5e-4
# what one more MLP slice of a chunk costs (three narrower GEMMs, the output read and written again by the accumulating
# GEMM): an estimate for the benchmark device (docs/budgets-and-tiers.md, Calibration); it keeps Q spans from buying
# 256-feature slices
SLICE_STEP_S = 1e-4
# Q spans tried: this many chunks' queries attended per pass over a store
SPAN_FACTORS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# shares of a store's rows the planner tries keeping on the device, each fit then topped up to the budget (a choice:
# each share is one more store search)
KEPT_SHARES = (0.5, 0.75, 0.875)
# of a store plan's room under its budget, the share its kept rows take, less a reserve: a plan the kept rows fill to
# the byte turns the memory model's own small errors into a budget missed (docs/budgets-and-tiers.md, "Rows kept on
# the card"). Choices
KEPT_FILL = 0.875
KEPT_RESERVE = 64 << 10
# each extra head group of L3 costs about this share of the attention's time (projections rerun, smaller attention
# calls); calibrated on the benchmark device (docs/budgets-and-tiers.md, Calibration)
L3_GROUP_COST = 0.1


@dataclass(frozen=True)
class KVOption:
    """A K/V store the planner may put a captured block's K/V in instead of whole device buffers (L4, L5): its
    memory model (bytes kept on the device, bytes per block row while a block is attended, bytes per query row of the
    log-sum-exp merge) and what it holds on the host. Block and merge bytes are for all heads: a store held in ``g``
    head groups (``groups``: the counts it allows) needs a ``g``-th of them at a time."""

    kind: str             # "host", "int8", "fp8" (executors.kv_store)
    tier: Tier            # L4 exact, L5 approximate
    resident: int         # K/V bytes the store keeps on the device
    block_row: int        # device bytes per K/V block row (double buffers, expanded copies)
    merge_row: int        # bytes per query row of the merge (fp32 accumulator, a block's partial output)
    host_bytes: int = 0   # K/V bytes held in host memory
    groups: tuple[int, ...] = (1,)
    merge_io_row: int = 0  # bytes the merge reads and writes per query row and block (its time)
    whole_row: int = 0    # bytes per query row during the attention that head groups do not divide
    # Q spans (``Plan.q_span``): bytes per query row of the attention's Q and of its output, both whole over a span;
    # 0: the block cannot attend a span of several chunks at once (``execute.kv_tiers.span_problem``)
    q_row: int = 0
    out_row: int = 0
    # device bytes the call's cache adds when it is filled after phase Q from this store (a cache that takes the
    # store's host rows as they are: an offloading cache's prefetch of another layer)
    fill: int = 0
    causal: bool = False  # every attention causal: a pass reads the blocks up to its last query row alone
    # its blocks attended on another kernel than the chunks' (``ConsumerCaps.kv_blocks_last_resort``): planned only
    # where no plan with K/V on the card fits
    last_resort: bool = False
    # a store that can keep its first rows on the device (``execute.kv_stores.HostStore``): device bytes per row kept
    # (every attention's K and V), the most rows it can keep (0: none), and the rows this option keeps
    kept_row: int = 0
    kept_max: int = 0
    kept: int = 0


def kept_option(option: KVOption, rows: int) -> KVOption:
    """``option`` with its first ``rows`` rows (at most ``kept_max``) kept on the device: resident there, not on the
    host, and read back by no pass."""
    rows = max(0, min(rows, option.kept_max)) if option.kept_row else 0
    extra = (rows - option.kept) * option.kept_row
    return replace(option, kept=rows, resident=option.resident + extra, host_bytes=option.host_bytes - extra)


@dataclass(frozen=True)
class Costs:
    """What the planner knows of a block's time (seconds; 0: unknown): the attention's, for a store's copies to hide
    under, and the block's work with the device's rates (``time_model``), by which legal plans are compared."""

    attention_s: float = 0.0   # all global attentions over all rows
    device: str = "cuda"
    work: Any = None           # ``graph.work.BlockWork``: None, not known
    rates: Rates | None = None  # None: no rates fitted for the device (plans chosen by memory, no predicted time)


def _read_share(option: KVOption, passes: int) -> float:
    """The share of the store's blocks a pass reads on average: all of them; causal, those up to its last query row
    (half of them and half a pass's more)."""
    return (passes + 1) / (2 * passes) if option.causal else 1.0


def host_traffic(option: KVOption, rows: int, chunk: int) -> int:
    """K/V out to the host once in phase KV and back once per pass over Q (causal: the blocks up to each pass's last
    query row); ``chunk``: the query rows of one pass (a chunk, or a plan's Q span)."""
    if not option.host_bytes:
        return 0
    passes = -(-rows // max(1, chunk))
    if option.kept and option.causal:   # each pass reads the host rows up to its last query row
        read = sum(max(0, min(p * chunk, rows) - option.kept) for p in range(1, passes + 1))
        return option.host_bytes + read * option.kept_row
    return option.host_bytes + int(option.host_bytes * passes * _read_share(option, passes))


def store_traffic(option: KVOption, rows: int, chunk: int, costs: Costs, block: int = DEFAULT_KV_BLOCK,
                  groups: int = 1) -> StoreTraffic:
    """What a store plan moves and does: its copies out and back, the merge's passes over the accumulator (one per
    block: longer blocks, fewer passes) and its block calls (one per pass, block and head group). ``chunk``: the
    query rows of one pass over the store (a chunk, or a plan's Q span)."""
    passes, blocks = -(-rows // max(1, chunk)), -(-rows // max(1, block))
    steps = passes * blocks * _read_share(option, passes)
    return StoreTraffic(option.host_bytes, host_traffic(option, rows, chunk) - option.host_bytes,
                        steps * min(chunk, rows) * option.merge_io_row, steps, groups, passes, costs.attention_s)


def l4_extra_seconds(option: KVOption, rows: int, chunk: int, costs: Costs, block: int = DEFAULT_KV_BLOCK,
                     groups: int = 1) -> float:
    """A store plan's seconds over the device tier's (``store_traffic`` at the device's rates; the benchmark
    device's where none are fitted)."""
    return store_seconds(store_traffic(option, rows, chunk, costs, block, groups), costs.rates or H200)


# a plan staging K/V in host memory is taken over one keeping them on the card only where the time model prices it
# this much faster: it pins the K/V's bytes of host memory, and a smaller gain is within the model's own error
# (its fit: rms 16% over the store plans measured; docs/budgets-and-tiers.md, the time model). A choice
STORE_MARGIN = 0.03

# chunks of one size a replayed plan needs (``execute.chunk_replay``): the first two run eager, and recording pays
# for itself over the rest
REPLAY_MIN_CHUNKS = 4

# row pieces the planner may cut a captured block's row-local runs in (fewest first), where the user did not set
# ``row_pieces``: each count's transient priced by the memory model, its launches by the time model (a choice)
ROW_PIECES = (2, 4, 8)
SLICES = (4096, 2048, 1024)  # MLP hidden features per slice the planner tries after half the MLP (GEMMs stay wide)
NARROWER_GAIN = 1.1          # a narrower slice is taken when it buys 10% more rows per chunk
L2_GAIN = 1.5                # L2 is taken over L1 when it buys 1.5x the rows per chunk


@dataclass(frozen=True)
class GraphPlanRequest:
    """``plan_graph``'s arguments (its docstring says what each is), held together so that the stages below and the
    peak models they price candidates by are functions of one request, not closures over twenty locals."""

    rows: int
    fixed: int
    transient: Callable[[int, int], int]
    stock: int
    chunk_tokens: int | None = None
    budget: int | None = None
    min_chunk: int = MIN_CHUNK_TOKENS
    waves: Waves = Waves()
    ffn: int = 0
    ffn_slice: int | None = None
    kv: int = 0
    attn_out: int = 0
    groups: tuple[int, ...] = ()
    head_groups: int | None = None
    kv_options: tuple[KVOption, ...] = ()
    kv_store: str = "device"
    costs: Costs = Costs()
    transient_kv: Callable[[int, int, int], int] | None = None
    whole_q: int = 0
    q_span: int | None = None
    kv_block: int | None = None   # K/V rows per block of a store the user fixed (with a chunk, or no budget)
    align: int = 1   # every chunk in whole units of this many rows (the attention consumer's ``q_align``)
    row_pieces: int = 1   # the row pieces ``transient`` is priced with (the user's, or a candidate's): its plans'
    pieces: tuple[int, ...] = ()   # other piece counts the planner may try (none: no row-local runs, or forced)
    # a piece count's (transient, transient_kv), priced by the same memory model with its runs in that many pieces
    priced: Callable[[int], tuple[Callable[[int, int], int], Callable[[int, int, int], int] | None]] | None = None
    fill: int = 0        # device bytes the call's cache adds at its fill, after phase Q, with K/V whole on the device
    fill_host: int = 0   # host bytes that cache keeps then (an offloading cache's copy)
    # ``transient`` without the fill (a store's spans: K/V in the store, the cache's fill priced by the store)
    bare: Callable[[int, int], int] | None = field(default=None, repr=False, compare=False)
    replay_row: int | None = None   # device bytes per row a replayed chunk stages (None: the block cannot replay)
    replay_held: int = 0            # device bytes a replayed call holds besides (the recording stream's workspace)
    replay: bool | None = None      # replay chunks: None the planner's choice by the time model, True where it
    # can (else as if False), False never
    replayed: bool = False          # this request's plans replay their chunks (``with_replay``)
    # at_attention's answers: a graph walk each, asked for again and again by the store searches
    _at_attention: dict[tuple[int, int, int], int] = field(default_factory=dict, init=False, repr=False,
                                                           compare=False)

    def normalised(self) -> GraphPlanRequest:
        """The request the stages plan: a whole-Q consumer's buffers held in ``fixed`` (one attention call, so no
        head groups and no K/V store), and the transient remembered per (chunk, slice)."""
        fixed, groups, head_groups, kv_options = self.fixed, self.groups, self.head_groups, self.kv_options
        if self.whole_q:
            if self.kv_store != "device":
                raise ValueError(f"kv={self.kv_store!r}: the attention needs the whole Q in one call, against K/V on "
                                 "the device")
            fixed, groups, head_groups, kv_options = fixed + self.whole_q, (), None, ()
        # a graph walk per (chunk, slice[, bytes alive at the attention]): the searches ask for the same ones often
        bare = functools.lru_cache(maxsize=None)(self.transient)
        return replace(self, fixed=fixed, groups=groups, head_groups=head_groups, kv_options=kv_options,
                       transient=self._filled(bare), bare=bare)

    def with_pieces(self, pieces: int) -> GraphPlanRequest:
        """This request with its row-local runs in ``pieces`` pieces: its transients priced so, its plans carrying
        the count."""
        transient, transient_kv = self.priced(pieces)
        bare = functools.lru_cache(maxsize=None)(transient)
        return replace(self, transient=self._filled(bare), bare=bare, transient_kv=transient_kv, row_pieces=pieces,
                       pieces=())

    def with_replay(self) -> GraphPlanRequest:
        """This request with its chunks replayed: each chunk's staged rows on top of its transient, and only the
        tiers a replay runs in (K/V whole on the device, no head groups)."""
        row, rows, inner, kv_inner = self.replay_row or 0, self.rows, self.bare or self.transient, self.transient_kv
        held = self.replay_held
        bare = functools.lru_cache(maxsize=None)(lambda c, sl: inner(c, sl) + min(c, rows) * row + held)
        kv = (lambda c, sl, extra: kv_inner(c, sl, extra) + min(c, rows) * row + held) if kv_inner is not None \
            else None
        return replace(self, transient=self._filled(bare), bare=bare, transient_kv=kv, groups=(), head_groups=None,
                       kv_options=(), pieces=(), priced=None, replayed=True)

    def _filled(self, transient: Callable[[int, int], int]) -> Callable[[int, int], int]:
        """``transient`` with the cache's fill as one more moment beside the whole buffers: after phase Q, whose
        transients are gone by then, K/V still whole."""
        fill = self.fill
        return transient if not fill else lambda c, sl: max(transient(c, sl), fill)

    def variants(self) -> list[GraphPlanRequest]:
        """This request, then one per piece count the planner may try (fewest first: fewer, larger kernels), where
        that count lowers a chunk's transient (with the MLP whole or at its narrowest slice): pieces that lower
        nothing buy no rows, and each count is another search."""
        if not self.priced:
            return [self]
        probe = min(self.rows, DEFAULT_CHUNK_TOKENS)
        slices = (0, MIN_FFN_SLICE) if self.ffn > MIN_FFN_SLICE else (0,)
        pieced = (self.with_pieces(p) for p in self.pieces if p != self.row_pieces)
        return [self, *(v for v in pieced if any(v.transient(probe, sl) < self.transient(probe, sl) for sl in slices))]

    @property
    def floors(self) -> tuple[int, ...]:
        """The chunk floors searched in turn: the caller's (GEMMs stay efficient), then the planner's own."""
        least = max(MIN_CHUNK_TOKENS, self.align)
        return tuple(dict.fromkeys((max(self.min_chunk, least), least)))

    @property
    def exact_kv(self) -> list[KVOption]:
        """The stores the planner may pick on its own: exact ones (L4); approximate ones only when asked for."""
        return [o for o in self.kv_options if o.tier == Tier.L4]

    def peak(self, chunk: int, sl: int = 0, g: int = 1) -> int:
        """K/V on the device: whole buffers (in ``g`` head groups a ``g``-th of K/V, the attention output whole)
        plus one chunk's transient."""
        grouped = (self.kv - self.kv // g - self.attn_out) if g > 1 else 0
        return self.fixed - grouped + self.transient(chunk, sl)

    def at_attention(self, c: int, sl: int, extra: int) -> int:
        """One chunk's worst moment with ``extra`` bytes per row alive during its attention (a store's merge)."""
        key = (c, sl, extra)
        if key not in self._at_attention:
            self._at_attention[key] = (self.transient_kv(c, sl, extra) if self.transient_kv is not None
                                       else (self.bare or self.transient)(c, sl) + c * extra)
        return self._at_attention[key]

    def peak_kv(self, opt: KVOption, chunk: int, sl: int, blk: int, g: int = 1, span: int = 0) -> int:
        """K/V in a store: what it keeps on the device, one block of it, and the chunk (or Q span) attending it."""
        rows = self.rows
        c = min(chunk, rows)
        held = self.fixed - self.kv
        base = held + opt.resident + min(blk, rows) * opt.block_row // g
        filled = held + opt.fill   # the cache's fill, after the store's buffers are let go
        if span <= c:
            return max(base + self.at_attention(c, sl, opt.merge_row // g + opt.whole_row), filled)
        # a span: its Q whole, then attended (the merge over the span's rows; with head groups, the output apart),
        # then its chunks run beside the span's output (or its Q, while being built)
        s = min(span, rows)
        attending = s * (opt.q_row + opt.merge_row // g + opt.whole_row + (opt.out_row if g > 1 else 0))
        bare = self.bare or self.transient
        return max(base + max(attending, s * max(opt.q_row, opt.out_row) + bare(c, sl)), filled)

    def make(self, tier: Tier, chunk: int, sl: int = 0, g: int = 1, opt: KVOption | None = None, blk: int = 0,
             span: int = 0) -> Plan:
        """The plan of one candidate, priced by its tier's peak model; a chunk the planner chose runs in whole
        attention waves, one the user fixed as given; either in whole units of the consumer's alignment."""
        rows, stock = self.rows, self.stock
        if tier == Tier.L0:
            return Plan(Tier.L0, rows, rows, 0, stock, stock)
        plan = self._make(tier, chunk, sl, g, opt, blk, span)
        plan.row_pieces = self.row_pieces
        plan.replay = self.replayed and tier in (Tier.L1, Tier.L2) and self.rows // max(plan.chunk, 1) \
            >= REPLAY_MIN_CHUNKS
        return plan

    def _make(self, tier: Tier, chunk: int, sl: int, g: int, opt: KVOption | None, blk: int, span: int) -> Plan:
        """A streamed candidate's plan (``make``'s), its peak from the store's or the device tiers' model."""
        rows, stock = self.rows, self.stock
        if self.chunk_tokens is None:
            chunk = self.waves.round(chunk, rows)
        chunk = min(aligned_chunk(chunk, self.align), rows)
        if opt is not None:   # a forced chunk reads K/V in blocks of its pass's rows (at most the default block
            span = min(span, rows) if span > chunk else 0   # per group)
            blk = min(blk or min(DEFAULT_KV_BLOCK * g, max(span or chunk, MIN_CHUNK_TOKENS)), rows)
            peak = self.peak_kv(opt, chunk, sl, blk, g, span)
            kv = opt.resident + min(blk, rows) * opt.block_row // g
            return Plan(opt.tier, rows, chunk, sl, peak, stock, kv=opt.kind,
                        kv_block=blk, host_traffic=host_traffic(opt, rows, span or chunk), head_groups=g,
                        q_span=span, host_bytes=opt.host_bytes, kv_kept=opt.kept,
                        parts=peak_parts(peak, kv, self.fixed - self.kv))
        peak = self.peak(chunk, sl, g)
        kv, held = (self.kv // g, self.fixed - self.kv + self.attn_out) if g > 1 else (self.kv, self.fixed - self.kv)
        return Plan(tier, rows, chunk, sl, peak, stock, head_groups=g, host_bytes=self.fill_host,
                    q="whole" if self.whole_q else "chunks", parts=peak_parts(peak, kv, held))

    @property
    def timed(self) -> bool:
        """Whether plans can be compared by the time model (the block's work and the device's rates known)."""
        return self.costs.work is not None and self.costs.rates is not None

    def time_ratio(self, plan: Plan) -> float | None:
        """The time model's ratio of ``plan``'s call to stock's (None: not modelled here)."""
        if plan.tier == Tier.L0:
            return 1.0
        if not self.timed:
            return None
        return time_ratio(self.costs.work, self.costs.rates, self._streamed(plan))

    def host_share(self, plan: Plan) -> float | None:
        """Of ``plan``'s predicted time, the share that is the host dispatching (``time_model.host_seconds``); None
        where not modelled."""
        if plan.tier == Tier.L0 or not self.timed:
            return None
        s = self._streamed(plan)
        return host_seconds(self.costs.work, self.costs.rates, s) / streamed_seconds(self.costs.work,
                                                                                      self.costs.rates, s)

    def _streamed(self, plan: Plan) -> Streamed:
        """What the time model reads of a streamed ``plan`` of this request."""
        store = steps = 0.0
        if plan.kv != "device":   # the copies that show, the merges, every block's call
            opt = self.option(plan)
            traffic = store_traffic(opt, self.rows, plan.q_span or plan.chunk, self.costs, plan.kv_block,
                                    plan.head_groups)
            store, steps = store_seconds(traffic, self.costs.rates), store_step_seconds(traffic, self.costs.rates)
        slices = -(-self.ffn // plan.ffn_slice) if self.ffn and plan.ffn_slice and plan.ffn_slice < self.ffn else 1
        # each attention call takes the query rows of one pass: a chunk's, or a store's Q span (a chunk of 4,096 rows
        # over one of 40 head groups fills a quarter of a wave; the 32,768-row span it runs in fills two)
        q_rows = (plan.q_span or plan.chunk) if plan.kv != "device" else plan.chunk
        waste = max(0.0, wave_waste(self.waves, q_rows, plan.head_groups) - wave_waste(self.waves, self.rows))
        # a store's head groups read its K/V back a group at a time (priced in ``store``); phase KV runs once
        groups = plan.head_groups if plan.kv == "device" else 1
        staged = 2 * self.rows * (self.replay_row or 0) if plan.replay else 0   # copied in and out of the staging
        return Streamed(plan.chunk, slices, groups, waste, store, plan.row_pieces, plan.replay, staged, steps)

    def option(self, plan: Plan) -> KVOption:
        """The store option ``plan`` runs, with the rows it keeps on the device."""
        return kept_option(next(o for o in self.kv_options if o.kind == plan.kv), plan.kv_kept)

    def staged_seconds(self, opt: KVOption, q_rows: int, blk: int, g: int) -> float:
        """A store's extra time (``l4_extra_seconds``) with the waves its passes leave part empty: each pass's calls
        over ``q_rows`` query rows and a ``g``-th of the heads fill fewer waves than stock's one call (how the store
        searches rank their candidates where the time model cannot)."""
        waste = max(0.0, wave_waste(self.waves, q_rows, g) - wave_waste(self.waves, self.rows))
        return l4_extra_seconds(opt, self.rows, q_rows, self.costs, blk, g) + waste * self.costs.attention_s


def plan_graph(rows: int, fixed: int, transient, stock: int, *, chunk_tokens: int | None = None,
               budget: int | None = None, min_chunk: int = MIN_CHUNK_TOKENS, waves: Waves = Waves(),
               ffn: int = 0, ffn_slice: int | None = None, kv: int = 0, attn_out: int = 0,
               groups: tuple[int, ...] = (), head_groups: int | None = None, kv_options: tuple[KVOption, ...] = (),
               kv_store: str = "device", costs: Costs = Costs(),
               transient_kv: Callable[[int, int, int], int] | None = None, whole_q: int = 0,
               q_span: int | None = None, kv_block: int | None = None, row_pieces: int = 1,
               pieces: tuple[int, ...] = (),
               priced: Callable[[int], tuple[Callable, Callable | None]] | None = None, fill: int = 0,
               fill_host: int = 0, align: int = 1, replay_row: int | None = None, replay_held: int = 0,
               replay: bool | None = None) -> Plan:
    """A captured block: whole buffers (``fixed``: K and V, the outputs) plus ``transient(chunk, ffn_slice)``, one
    chunk's values at their worst moment, both read off the graph. ``ffn``: the widest feature-sliceable MLP (0: none),
    for L2. L3 (``groups``: the head-group counts the graph allows): K and V of one group of heads at a time
    (``kv`` of ``fixed`` divided by the groups) and the attention output whole (``attn_out``).
    L4/L5 (``kv_options``): K/V in a store (no whole K/V on the device: what the store keeps there, its block
    buffers and the merge); ``kv_store`` other than "device" forces that store; "device" lets the planner stage K/V to
    the host (L4, exact) below the floor, weighed against L3 by estimated time (``costs``); an approximate store (L5)
    is used only when asked for. ``transient_kv(chunk, slice, extra)``: the transient with ``extra`` bytes per row alive
    during the attention alone (default: alive throughout). ``whole_q`` (bytes, 0: chunked Q): the consumer needs
    every query row in one call: the whole Q and the whole attention output are held beside K, V and one chunk's
    transient (which ``transient`` prices with the whole call's workspace), on L1/L2 plans alone (head groups and K/V
    stores would split that call). ``q_span``: a forced store at a fixed chunk attends this many query rows per pass
    (where its option allows spans: ``KVOption.q_row``), reading ``kv_block`` K/V rows per block where given.
    ``row_pieces``: the row pieces ``transient`` is priced with;
    ``pieces``: other counts the planner may cut the block's row-local runs in, each priced by ``priced(count)``
    (its ``transient`` and ``transient_kv``): a lower peak per row buys larger chunks for more launches. ``fill``:
    device bytes a cache the call fills adds after phase Q, beside K/V still whole on the device (``fill_host``: the
    host bytes it keeps then); with K/V in a store, its option's ``fill``. ``align``: the attention consumer's query
    alignment (``ConsumerCaps.q_align``): every chunk, chosen or forced, in whole units of it. ``replay_row``: device
    bytes per row a replayed chunk stages (None: the block's chunks cannot replay), ``replay_held`` the bytes a
    replayed call holds besides (the recording stream's workspace); ``replay``: the user's choice (None: by the time
    model, True: where a replayed plan fits, False: never)."""
    request = GraphPlanRequest(
        rows, fixed, transient, stock, chunk_tokens=chunk_tokens, budget=budget, min_chunk=min_chunk, waves=waves,
        ffn=ffn, ffn_slice=ffn_slice, kv=kv, attn_out=attn_out, groups=groups, head_groups=head_groups,
        kv_options=kv_options, kv_store=kv_store, costs=costs, transient_kv=transient_kv, whole_q=whole_q,
        q_span=q_span, kv_block=kv_block, row_pieces=row_pieces, pieces=pieces if priced is not None else (),
        priced=priced, fill=fill, fill_host=fill_host, align=align, replay_row=replay_row, replay_held=replay_held,
        replay=replay).normalised()
    plan = _chosen(request)
    plan.predicted_time_ratio = request.time_ratio(plan)
    plan.predicted_host_share = request.host_share(plan)
    return plan


def _chosen(request: GraphPlanRequest) -> Plan:
    """Chunk replay where asked for and a replayed plan fits (else as if not asked), then ``_chosen_plan``."""
    if request.replay and request.replay_row is not None and request.kv_store == "device" \
            and request.head_groups in (None, 1):   # (head groups the user set are not replayed: theirs is kept)
        try:
            return _chosen_plan(request.with_replay())
        except BudgetError:
            pass
    return _chosen_plan(request)


def _replay_weighed(request: GraphPlanRequest) -> bool:
    """Whether the planner weighs replayed plans against the others by the time model (the user left it to it)."""
    return (request.replay is None and request.replay_row is not None and request.timed and not request.replayed
            and request.costs.rates.replay_op is not None)


def _chosen_plan(request: GraphPlanRequest) -> Plan:
    """The store asked for, the plan forced, stock where it fits, else the fastest legal plan under the budget; a
    store whose blocks run on another kernel than the chunks' only where nothing else fits."""
    if request.kv_store != "device":
        return _store_plan(request)
    first = tuple(o for o in request.kv_options if not o.last_resort)
    if len(first) < len(request.kv_options):
        try:
            return _plan_of(replace(request, kv_options=first))
        except BudgetError:
            pass
    return _plan_of(request)


def _plan_of(request: GraphPlanRequest) -> Plan:
    """``_chosen_plan`` for a request on K/V on the card or any of its stores."""
    forced = _forced_plan(request)
    if forced is not None:
        replayed = _forced_plan(request.with_replay()) if _replay_weighed(request) else None
        if replayed is not None and replayed.tier == forced.tier and \
                request.time_ratio(replayed) < request.time_ratio(forced):
            return replayed
        return forced
    if stock_fits(request.stock, request.budget):
        return request.make(Tier.L0, request.rows)
    variants = request.variants()   # the request, then its runs in each count of row pieces
    if request.timed:   # every floor's candidates, the fastest by the time model (ties: fewer pieces, no replay)
        if _replay_weighed(request):
            variants = variants + [v.with_replay() for v in variants]
        legal = [p for v in variants for floor in request.floors for p in _candidates(v, floor)]
        if legal:
            return min(legal, key=lambda p: request.time_ratio(p) * (1 + STORE_MARGIN if p.kv != "device" else 1))
    for floor in request.floors:
        plan = _fastest_under_budget(request, floor, variants[1:])
        if plan is not None:
            return plan
    raise _refusal(variants)


def _store_plan(request: GraphPlanRequest) -> Plan:
    """The store the user named (``kv_store``) whatever the budget: its K/V never go whole onto the device, so the
    ladder's other tiers are not tried; the refusal names the store's own floor."""
    forced = next((o for o in request.kv_options if o.kind == request.kv_store), None)
    if forced is None:
        raise ValueError(f"kv={request.kv_store!r}: no such K/V store for this block")
    if request.chunk_tokens is not None or request.budget is None:
        ffn, ffn_slice = request.ffn, request.ffn_slice
        g = request.head_groups if request.head_groups in forced.groups else 1
        return request.make(forced.tier, request.chunk_tokens or DEFAULT_CHUNK_TOKENS,
                            min(ffn_slice, ffn) if ffn_slice is not None and ffn else 0, g, opt=forced,
                            blk=request.kv_block or 0, span=(request.q_span or 0) if forced.q_row else 0)
    for floor in request.floors:
        plan = _fit_store(request, forced, floor)
        if plan is not None:
            return _topped_up(request, forced, plan)
    least = request.peak_kv(forced, min(request.rows, request.floors[-1]), 256 if request.ffn > 256 else 0,
                            KV_BLOCKS[-1])
    raise BudgetError(f"captured block over {request.rows} rows with kv={request.kv_store!r}: "
                      f"{fmt_bytes(request.budget)} left for it is below the smallest peak that store reaches "
                      f"({fmt_bytes(least)})", least=least)


def _forced_plan(request: GraphPlanRequest) -> Plan | None:
    """What the user fixed (head groups, an MLP slice, a chunk), or with no budget the default chunk: no search, the
    user's choice taken as given; None: the planner chooses."""
    r = request
    if r.head_groups is not None and r.head_groups > 1 and r.head_groups in r.groups:
        return r.make(Tier.L3, r.chunk_tokens or DEFAULT_CHUNK_TOKENS, min(r.ffn_slice or 0, r.ffn), r.head_groups)
    if r.ffn_slice is not None and r.ffn:
        return r.make(Tier.L2, r.chunk_tokens or DEFAULT_CHUNK_TOKENS, min(r.ffn_slice, r.ffn))
    if r.chunk_tokens is not None or r.budget is None:
        return _fixed(r.rows, r.chunk_tokens, r.make)
    return None


def _fastest_under_budget(request: GraphPlanRequest, floor: int, pieced: Sequence[GraphPlanRequest] = ()
                          ) -> Plan | None:
    """Down the ladder with chunks of at least ``floor`` rows: row chunks (L1, or L2 where slicing the MLP buys
    enough rows), narrower slices (L2), the same with the row-local runs in pieces (``pieced``: one request per
    count) where that buys ``L2_GAIN`` times the rows or nothing fits whole, then the faster of head groups (L3) and
    host-staged K/V (L4) by estimated extra time; None: nothing fits at this floor."""
    plan = _pieced_plan(floor, _whole_rows_plan(request, floor), pieced)
    if plan is not None:
        return plan
    # the faster legal tier by estimated extra time: L3 reruns projections per group, L4 copies K/V (ties: no pieces)
    legal = [p for r in (request, *pieced)
             for p in (_grouped_plan(r, floor), *(_fit_store(r, o, floor) for o in r.exact_kv)) if p is not None]
    return min(legal, key=lambda p: _extra_seconds(request, p)) if legal else None


def _whole_rows_plan(request: GraphPlanRequest, floor: int) -> Plan | None:
    """L1 (or L2 where slicing buys enough rows), else the widest slice that fits: K/V whole, no head groups."""
    plan = _row_chunk_plan(request, floor)
    return plan if plan is not None else _narrow_slice_plan(request, floor)


def _pieced_plan(floor: int, plan: Plan | None, pieced: Sequence[GraphPlanRequest]) -> Plan | None:
    """The fewest row pieces whose plan (as ``_whole_rows_plan`` takes it) reaches ``L2_GAIN`` times ``plan``'s rows
    per chunk, or fits where ``plan`` (None) does not: pieces are more, shorter kernels, taken for the rows they buy
    (before head groups, which rerun projections); else ``plan``."""
    for r in pieced:
        p = _whole_rows_plan(r, floor)
        if p is not None and (plan is None or p.chunk >= L2_GAIN * plan.chunk):
            return p
    return plan


def _candidates(request: GraphPlanRequest, floor: int) -> list[Plan]:
    """Every tier's best-fitting plan with chunks of at least ``floor`` rows: row chunks (L1), the MLP sliced (L2:
    the widest slice that fits, and each narrower one that buys rows), head groups (L3), K/V staged on the host
    (L4). The time model picks among them: at short lengths small chunks cost more than at long ones, and head
    groups or a store can be slower than narrower chunks."""
    r = request
    out = []
    chunk = _largest_chunk(lambda c: r.fixed + r.transient(c, 0), r.rows, r.budget, floor)
    if chunk is not None:
        out.append(r.make(Tier.L1, chunk))
    for sl in sorted({-(-r.ffn // 2), *SLICES, 512, 256} if r.ffn else (), reverse=True):
        if sl >= r.ffn or sl < MIN_FFN_SLICE:
            continue
        c = _largest_chunk(lambda c: r.fixed + r.transient(c, sl), r.rows, r.budget, floor)
        if c is not None:
            out.append(r.make(Tier.L2, c, sl))
    out += [p for p in (_grouped_fit(r, floor, g) for g in r.groups) if p is not None]
    for o in r.exact_kv:   # each store's fastest fit, keeping what rows the budget has room for; then more kept
        fit = _fit_store(r, o, floor)
        out += ([_topped_up(r, o, fit)] if fit is not None else []) + _kept_store_plans(r, o, floor)
    return out


def _row_chunk_plan(request: GraphPlanRequest, floor: int) -> Plan | None:
    """L1's largest chunk, unless slicing the MLP (in row pieces: exact, GEMMs as wide) buys ``L2_GAIN`` times the
    rows: row chunks cost time (per-chunk work, text rows recomputed, attention calls)."""
    r = request
    chunk = _largest_chunk(lambda c: r.fixed + r.transient(c, 0), r.rows, r.budget, floor)
    if (chunk is None or chunk < r.rows) and r.ffn > SLICES[0]:
        wider = _widest_slice(r, floor)
        if wider is not None and (chunk is None or r.waves.round(wider[0], r.rows)
                                  >= L2_GAIN * r.waves.round(chunk, r.rows)):
            return r.make(Tier.L2, *wider)
    return None if chunk is None else r.make(Tier.L1, chunk)


def _widest_slice(request: GraphPlanRequest, floor: int) -> tuple[int, int] | None:
    """(chunk, slice) of the widest MLP slice among half the MLP and ``SLICES`` whose chunk a narrower one does not
    beat by more than ``NARROWER_GAIN``: narrower slices are more, smaller GEMMs (row pieces), but larger chunks
    are fewer passes of everything, and on the benchmark device fewer, wider pieces ran as fast or faster
    (docs/budgets-and-tiers.md, Calibration).
    Chunks compare as they will run, rounded to whole attention waves: a narrower slice whose extra rows the
    rounding takes back buys nothing (H3 at 65,536 rows: 12,672 rows either way, 7 slices or 4)."""
    r, best = request, None
    for sl in sorted({-(-r.ffn // 2), *(s for s in SLICES if s < r.ffn)}, reverse=True):
        c = _largest_chunk(lambda c: r.fixed + r.transient(c, sl), r.rows, r.budget, floor)
        if c is not None and (best is None
                              or r.waves.round(c, r.rows) > r.waves.round(best[0], r.rows) * NARROWER_GAIN):
            best = (c, sl)
    return best


def _narrow_slice_plan(request: GraphPlanRequest, floor: int) -> Plan | None:
    """L2 where no row chunk fits whole: the widest slice down to ``MIN_FFN_SLICE`` that lets a chunk fit."""
    r = request
    for sl in (4096, 2048, 1024, 512, 256) if r.ffn else ():
        if sl >= r.ffn:
            continue
        chunk = _largest_chunk(lambda c: r.fixed + r.transient(c, sl), r.rows, r.budget, floor)
        if chunk is not None:
            return r.make(Tier.L2, chunk, sl)
    return None


def _grouped_plan(request: GraphPlanRequest, floor: int) -> Plan | None:
    """L3: the fewest head groups, then the widest MLP slice, whose largest chunk fits (fewer groups rerun fewer
    projections)."""
    return next((p for p in (_grouped_fit(request, floor, g) for g in request.groups) if p is not None), None)


def _grouped_fit(request: GraphPlanRequest, floor: int, g: int) -> Plan | None:
    """L3 in ``g`` head groups: the widest MLP slice whose largest chunk fits."""
    r = request
    for sl in (0, 4096, 1024, 256) if r.ffn else (0,):
        if sl >= r.ffn and sl:
            continue
        chunk = _largest_chunk(lambda c: r.peak(c, sl, g), r.rows, r.budget, floor)
        if chunk is not None:
            return r.make(Tier.L3, chunk, sl, g)
    return None


class _StoreFit(NamedTuple):
    """One store candidate: its sort key (lower is better) and what its plan is made of."""

    key: tuple
    chunk: int
    sl: int
    blk: int
    g: int
    span: int


def _fit_store(request: GraphPlanRequest, opt: KVOption, floor: int) -> Plan | None:
    """The fastest (Q chunk, Q span, K/V block, head groups, MLP slice) this store reaches under the budget: where
    the device's rates are known, by the time model the planner ranks every tier by (ties: the store's estimated
    extra time); else the largest Q chunk, then the largest span, then the largest block."""
    r, fits = request, []
    for g in opt.groups:
        for sl in (0, 4096, 2048, 1024, 256) if r.ffn else (0,):
            if sl and sl >= r.ffn:
                continue
            for blk in sorted({min(b, r.rows) for b in KV_BLOCKS}, reverse=True):
                for m in SPAN_FACTORS if opt.q_row else (1,):
                    fit = _store_fit(r, opt, floor, g, sl, blk, m)
                    if fit is not None:
                        fits.append(fit)
    plans = [(fit.key, r.make(opt.tier, fit.chunk, fit.sl, fit.g, opt=opt, blk=fit.blk, span=fit.span))
             for fit in fits]
    if not plans:
        return None
    if r.timed:
        return min(plans, key=lambda kp: (r.time_ratio(kp[1]), kp[0]))[1]
    return min(plans, key=lambda kp: kp[0])[1]


def _store_fit(request: GraphPlanRequest, opt: KVOption, floor: int, g: int, sl: int, blk: int,
               m: int) -> _StoreFit | None:
    """The largest chunk a store fits with Q spans of ``m`` chunks at these settings, and how it ranks: a span
    counts only if it is more than its chunk and still fits once the chunk is rounded to whole waves."""
    r, rows = request, request.rows
    chunk = _largest_chunk(lambda c: r.peak_kv(opt, c, sl, blk, g, m * c), rows, r.budget, floor)
    if chunk is None:
        return None
    c = r.waves.round(chunk, rows)
    span = min(m * c, rows)
    if m > 1 and (span <= c or r.peak_kv(opt, c, sl, blk, g, span) > r.budget):
        return None
    passes = span if m > 1 else c
    eps = 0.0 if not sl else 1e-9   # an unsliced MLP on ties
    if r.costs.attention_s:
        chunks = -(-rows // c)
        # a pass's calls over fewer heads and rows than stock's one call fill fewer waves
        key = (r.staged_seconds(opt, passes, blk, g) + chunks * CHUNK_STEP_S
               + (chunks * -(-r.ffn // sl) * SLICE_STEP_S if sl else 0.0) + eps,
               -passes, -c, -blk, g, sl)
    else:   # rates unknown: the largest chunk, then the largest span it allows
        key = (eps, -c, -passes, -blk, g, sl)
    return _StoreFit(key, chunk, sl, blk, g, span if m > 1 else 0)


def _kept_store_plans(request: GraphPlanRequest, opt: KVOption, floor: int) -> list[Plan]:
    """A store that keeps its first rows on the device (``KVOption.kept_row``), for each of ``KEPT_SHARES``: its
    fastest fit in one head group (a budget with room for most of K/V has no need of groups), then topped up to the
    budget. Between K/V whole on the card and all of them on the host: a pass copies back only the rest."""
    if not opt.kept_row or not opt.kept_max:
        return []
    plans = (_fit_store(request, replace(kept_option(opt, int(share * opt.kept_max)), groups=(1,)), floor)
             for share in KEPT_SHARES)
    return [_topped_up(request, opt, p) for p in plans if p is not None]


def _topped_up(request: GraphPlanRequest, opt: KVOption, plan: Plan) -> Plan:
    """A store ``plan`` keeping as many more of its first rows on the device as ``KEPT_FILL`` of the budget's room
    (less ``KEPT_RESERVE``) holds: the same chunks and blocks, fewer rows copied back."""
    room = int(KEPT_FILL * ((request.budget or 0) - plan.predicted_peak)) - KEPT_RESERVE
    if plan.kv != opt.kind or not opt.kept_row or room < opt.kept_row or plan.kv_kept >= opt.kept_max:
        return plan
    more = kept_option(opt, plan.kv_kept + room // opt.kept_row)
    topped = request.make(plan.tier, plan.chunk, plan.ffn_slice, plan.head_groups, opt=more, blk=plan.kv_block,
                          span=plan.q_span)
    return topped if topped.predicted_peak <= request.budget else plan


def _extra_seconds(request: GraphPlanRequest, plan: Plan) -> float:
    """What a below-the-floor plan costs over stock: L3 reruns projections per group, L4 copies K/V."""
    if plan.tier == Tier.L3:
        return (plan.head_groups - 1) * L3_GROUP_COST * request.costs.attention_s
    return request.staged_seconds(request.option(plan), plan.q_span or plan.chunk, plan.kv_block, plan.head_groups)


def _refusal(variants: list[GraphPlanRequest]) -> BudgetError:
    """Nothing fits: the error names the smallest peak any tier reaches (one floor-sized chunk, the narrowest slice,
    in any count of row pieces tried), so the user knows how far the budget is from a plan."""
    r = variants[0]
    least = min(_least(v) for v in variants)
    held = ", the whole Q and attention output" if r.whole_q else ""
    return BudgetError(f"captured block over {r.rows} rows: {fmt_bytes(r.budget)} left for it is below the smallest "
                       f"peak streamplan can reach ({fmt_bytes(least)}: global K, V{held} and the outputs "
                       f"{fmt_bytes(r.fixed)}, and one {r.floors[-1]}-row chunk)", least=least)


def _least(r: GraphPlanRequest) -> int:
    """The smallest peak one request's tiers reach: one floor-sized chunk at the narrowest slice."""
    c, sl = min(r.rows, r.floors[-1]), 256 if r.ffn > 256 else 0
    return min([r.fixed + r.transient(c, sl)] + [r.peak(c, sl, g) for g in r.groups]
               + [r.peak_kv(o, c, sl, KV_BLOCKS[-1]) for o in r.exact_kv])
