"""Below the floor on the captured-graph path: what ``apply(..., kv=...)`` asks for, which K/V stores a captured block
can use, their memory model for the planner (``planner.KVOption``), and running a block with its K/V in a store
(``execute.kv_stores``), the error of an approximate store measured on its first call in a chunk's memory (a few
query rows attended against exact K/V as phase KV makes them: a compressed tier is chosen because exact K/V do not fit,
so no call of it, the first included, may hold them).

``kv="device"`` (the default) is exact: K/V stay whole on the device wherever the budget allows; below the floor the
planner takes the faster of L3 (head groups) and, on CUDA, L4 (host-staged K/V, in head groups of its own) by estimated
extra time. ``kv="host"`` forces L4. ``kv="int8"`` and ``kv="fp8"`` (L5) are approximate and used only when asked for.
A call that fills a cache keeps its K/V on the device, unless the cache keeps K/V in host memory and takes a host
store's rows as they are (``AdaptedCall.host_fill``: an offloading cache): then L4 in one head group may hold them,
and the cache is filled from the store's buffers; what each fill adds is priced (``cache_bytes``).
(Host staging keeps its device block buffers through phase Q and makes every cross-stream use wait on an event: a buffer
allocated for a new Q chunk and filled on the copy stream without a wait could overwrite memory the compute stream is
still using for the previous chunk.)"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from .call_state import rehearsing
from .context import CallContext
from .call_ledger import phase
from .kv_stores import APPROXIMATE, KV_KINDS, WRITE_ROWS, KVProbe, attend_blocks, make_store, store_kind
from ..graph.work import block_work
from ..plan.budget import fmt_bytes
from ..plan.time_model import rates_for
from ..plan.planner import ATTENTION_RATE, Costs, KVOption, Tier

log = logging.getLogger("streamplan")


def check_kv(kv: Any) -> str:
    """``kv`` validated: one of the store kinds, else a ValueError that names them."""
    if not isinstance(kv, str) or kv.strip().lower() not in KV_KINDS:
        raise ValueError(f"kv must be one of {', '.join(repr(k) for k in KV_KINDS)} (where K/V live between the "
                         f"phases: 'device' exact, the default; 'host' exact, host-staged (L4); 'int8' or 'fp8' "
                         f"compressed, approximate (L5)), got {kv!r}")
    return kv.strip().lower()


def kv_problem(found, consumer, adapted: Any = None) -> str | None:
    """Why this captured block cannot keep its K/V in a store (L4/L5), or None."""
    an = found.analysis
    if not an.attentions:
        return "no global attention (no whole K/V to stage)"
    if not getattr(consumer.caps, "kv_blocks_lse", False) or not callable(getattr(consumer, "attend_lse", None)):
        return (f"attention backend {consumer.name} does not attend K/V in blocks with a log-sum-exp "
                f"(kv_blocks_lse): K/V stay whole on the device")
    if adapted is not None and adapted.host_fill is None:
        return ("the call's cache is filled from the whole K/V: they stay on the device" if adapted.held == "device"
                else f"the call's offloading cache is filled from device K/V ({adapted.host_problem}): they stay on "
                     f"the device")
    for att in an.attentions:
        if getattr(att, "mask", None) is not None:
            return "a masked attention: its chunks attend K/V whole on the device"
        if getattr(att, "softcap", 0.0):
            return "a soft-capped attention: its chunks attend K/V whole on the device"
        if getattr(att, "sinks", None) is not None:
            return "an attention with sinks: its chunks attend K/V whole on the device"
        k = att.k.meta["val"]
        if k.dim() != 4 or att.kv_rows.dim != 2 or att.causal and (att.kv_rows.pre or att.kv_rows.post):
            return "a global attention's K/V are not [batch, heads, rows, head_dim] over the rows alone"
    return None


def span_problem(found) -> str | None:
    """Why phase Q cannot attend a span of several chunks' queries in one pass over a store (``Plan.q_span``), or
    None: one global attention, no halo, Q ``[batch, heads, rows, head_dim]``. Static query rows (text joined to the
    rows) go with the first span's queries, as with the phase's first chunk; not beside a causal attention, whose
    query offsets count the dynamic rows alone."""
    an = found.analysis
    if len(an.attentions) != 1:
        return f"the block has {len(an.attentions)} global attentions, not one"
    if an.halo != (0, 0):   # phase Q's query rows are widened by the halo, chunk by chunk
        return "a convolution along the rows widens each chunk's query rows by its halo"
    att = an.attentions[0]
    if att.q_rows is None or att.q_rows.dim != 2:
        return "its Q is not [batch, heads, rows, head_dim]"
    if att.causal and (att.q_rows.pre or att.q_rows.post):
        return "static query rows beside a causal attention"
    return None


def _ints(shape) -> list[int] | None:
    out = []
    for s in shape:
        if not isinstance(s, int):
            try:
                s = int(s)
            except (TypeError, ValueError):
                return None
        out.append(s)
    return out


def cache_bytes(adapted: Any, kv_bytes: int, stored: bool = False) -> tuple[int, int]:
    """(device, host) bytes the call's cache adds when it is filled after phase Q with K/V of ``kv_bytes``. From K/V
    on the device: its own copy of them (a ``DynamicLayer`` concatenates onto an empty tensor; a quantized layer's
    codes are fewer), which an offloading cache then moves to host memory, while it brings one other layer's K/V (as
    many bytes, at most) to the device. ``stored``: from a host store the cache takes as it is: that other layer
    alone, and no host bytes beyond the store's."""
    if adapted is None:
        return 0, 0
    offloading = adapted.held == "host"
    if stored:
        return (kv_bytes if offloading else 0), 0
    return kv_bytes * (2 if offloading else 1), (kv_bytes if offloading else 0)


def kv_options(found, rows: int, device: torch.device, kinds: tuple[str, ...], spans: bool = False,
               adapted: Any = None) -> tuple[KVOption, ...]:
    """The memory model of each store kind in ``kinds`` for this block at ``rows`` rows; ``spans``: the block can
    attend a span of several chunks' queries in one pass (``span_problem``; any static query rows with the first);
    ``adapted``: a cache filled from the store after phase Q (one head group: its rows are one view per K and V)."""
    an = found.analysis
    opts = []
    for kind in kinds:
        sk = store_kind(kind)
        resident = host = block_row = merge_row = merge_io = whole_row = q_row = out_row = whole = kept_row = 0
        kept_max: int | None = None
        for att in an.attentions:
            kv_ = att.k.meta["val"]
            q = att.q.meta["val"]
            dims = _ints((kv_.shape[0], kv_.shape[1], kv_.shape[-1], q.shape[1]))
            if dims is None:
                return ()
            B, Hkv, D, H = dims
            e = kv_.element_size()
            total = rows + att.kv_rows.pre + att.kv_rows.post
            elems = 2 * B * Hkv * D                      # K and V, one row
            kept_row += elems * e
            kept_max = total if kept_max is None else min(kept_max, total)
            resident += int(total * elems * sk.resident(e, D))
            if kind == "host" and device.type != "cpu":   # phase KV's two write buffers (execute.kv_stores)
                resident += 2 * WRITE_ROWS * elems * e
            host += total * elems * e if sk.on_host else 0
            whole += total * elems * e
            if kind == "host":   # two block buffers in turn on CUDA; in a CPU run views of host rows, which the CPU
                row = 2 * elems * e if device.type != "cpu" else elems * e   # kernel copies contiguous
            else:                # the block expanded (K and V in the compute dtype) and its fp32 working copies
                row = elems * e + 2 * (elems // 2) * 4
            block_row = max(block_row, row)
            # during the attention: the fp32 accumulator and a block's partial output (the result is the attention's
            # own output); phase KV: a chunk's rows-first copy and, compressing, its fp32 working copies
            merge = B * H * D * (4 + e) + 8 * B * H
            if att.causal and H > Hkv:   # a causal diagonal's K/V heads repeated to the query heads for the fused
                merge += 2 * B * H * D * e   # kernel (attention.sdpa.attend_lse): as many keys as its query rows
            if device.type == "cpu":   # PyTorch's CPU flash kernel keeps buffers of its own per call, counted as
                whole_row = max(whole_row, B * H * D * (8 + 2 * e))   # two fp32 outputs and two in the dtype per row
                # of all heads, however few heads the call has (attention.sdpa)
            write = (0 if kind == "host" and device.type != "cpu" else elems * e) + (0 if sk.exact else 3 * elems * 4)
            merge_row = max(merge_row, merge, write)
            merge_io += B * H * D * (4 * 4 + e)   # per block: the accumulator read and written twice, the partial read
            if spans:
                qr, orow = B * H * D * q.element_size(), B * H * D * att.node.meta["val"].element_size()
                q_row, out_row = q_row + qr, out_row + orow
                # the first span's static query rows (``span_problem``): its Q, merge and output hold them too. A
                # constant the per-row span bytes cannot carry: held with the store's, so a plan without spans is
                # priced with them too (its first chunk attends those rows as well)
                static = att.q_rows.pre + att.q_rows.post if att.q_rows is not None else 0
                resident += static * (qr + orow + merge + whole_row)
        tier = Tier.L4 if sk.exact else Tier.L5
        groups = head_groups(an) if adapted is None else (1,)
        # its first rows kept on the device (a cache filled from the store takes its host rows whole: none kept)
        keeps = sk.keeps_rows and adapted is None
        opts.append(KVOption(kind, tier, resident, block_row, merge_row, host, groups, merge_io, whole_row,
                             q_row, out_row, cache_bytes(adapted, whole, stored=True)[0],
                             causal=all(att.causal for att in an.attentions),
                             kept_row=kept_row if keeps else 0, kept_max=(kept_max or 0) if keeps else 0))
    return tuple(opts)


MAX_HEAD_GROUPS = 64   # up to one K/V head a group: a group small enough to read all its rows back in one block


def head_groups(an) -> tuple[int, ...]:
    """Head-group counts a store may hold every global attention's K/V in: those dividing all K/V head counts."""
    counts = [int(att.k.meta["val"].shape[1]) for att in an.attentions]
    return tuple(g for g in range(1, MAX_HEAD_GROUPS + 1) if all(h % g == 0 for h in counts)) or (1,)


def costs(found, rows: int, device: torch.device) -> Costs:
    """What the planner knows of the block's time on this device: its work (``graph.work``) and the device's fitted
    rates where there are some (the time model), the attention's seconds from its FLOPs where the rate is known."""
    rate, rates = ATTENTION_RATE.get(device.type), rates_for(device.type)
    if not rate:
        return Costs(0.0, device.type)
    work = block_work(found, rows)
    return Costs(work.attention_flops / rate, device.type, work=work if rates else None, rates=rates)


def options_for(found, rows: int, device: torch.device, kv: str, consumer, adapted: Any = None, spans: bool = False
                ) -> tuple[tuple[KVOption, ...], str | None]:
    """The stores the planner may use for this call (the one asked for; none under "device"), and why
    none can be used (None when they can)."""
    why = kv_problem(found, consumer, adapted)
    if why is not None:
        return (), why
    if adapted is not None and kv in APPROXIMATE:
        return (), "the call's cache is filled with exact K/V: they stay on the device"
    if kv == "device":   # L4 where the host is apart from the device and its cost is known: weighed against L3
        opts = kv_options(found, rows, device, ("host",), spans, adapted) if device.type in ("cuda", "meta") else ()
    else:
        opts = kv_options(found, rows, device, (kv,), spans, adapted)
    if getattr(consumer.caps, "kv_blocks_last_resort", False):   # its blocks on another kernel than its chunks'
        opts = tuple(replace(o, last_resort=True) for o in opts)
    return opts, None


def store_factory(kind: str, device: torch.device, block_rows: int, groups: int = 1, kept: int = 0
                  ) -> Callable[[Any], Any]:
    return lambda att: make_store(kind, device, block_rows, groups, kept)


def store_attend(consumer) -> Callable[..., torch.Tensor]:
    def attend(q, store, *, q_offset, causal, scale):
        return attend_blocks(consumer, q, store, q_offset=q_offset, causal=causal, scale=scale)
    return attend


PROBE_ROWS = 256   # query rows an approximate store's error check attends against exact K/V (at most a chunk's)


@dataclass
class KVError:
    """An approximate store's error on the first call per shape: its last ``rows`` query rows (every head) attended
    against the store and against exact K/V, the attention outputs compared (where the compression enters the block).
    Exact K/V are attended chunk by chunk as phase KV makes them, never held whole: the check's extra memory is
    ``extra_bytes`` (those query rows and their fp32 accumulators), not a second K/V."""

    kind: str
    rel: float
    max_abs: float
    rows: int = 0
    extra_bytes: int = 0

    def describe(self) -> str:
        return (f"kv={self.kind} (L5, approximate): attention output error against exact K/V, first call, its last "
                f"{self.rows} query rows, every head: rel {self.rel:.2e}, max abs {self.max_abs:.2e} (checked in a "
                f"chunk's memory: exact K/V attended as phase KV made them, never whole; {fmt_bytes(self.extra_bytes)} "
                f"extra. The block's output against stock: self_check=True, at stock's peak)")


def _probes(run, plan, consumer) -> dict:
    """A ``KVProbe`` per global attention: its Q over the last rows of phase Q's last chunk (at most ``PROBE_ROWS``),
    built before phase KV (later, a donated input may have been written over)."""
    from .chunk_loop import chunk_bounds
    a, b = list(chunk_bounds(run.rows, plan.chunk, run.cap.min_rows))[-1]
    probes = {}
    for att in run.an.attentions:
        r = att.q_rows
        if r is None or r.dim != 2:
            continue
        q = run.query_rows(att, a, b)
        m = min(PROBE_ROWS, b - a)
        q = q.narrow(2, r.pre + (b - a) - m, m).clone()   # only these rows are kept: the chunk's Q let go
        probes[att.node] = KVProbe(consumer, q, b - m, att.causal, att.scale, plan.head_groups, plan.kv_block)
    return probes


def run_with_store(run, plan, device: torch.device, consumer, donate: dict, check: bool = False,
                   fill: Callable[[torch.Tensor, torch.Tensor, torch.device], None] | None = None):
    """Phase KV into the plan's store, phase Q against its blocks. ``check`` (an approximate store's first call):
    the store's error measured in a chunk's memory (``KVProbe``) between the phases. ``fill``: a cache that takes the
    store's host rows as they are (``AdaptedCall.host_fill``), filled after phase Q. Returns ``(output, KVError or
    None)``."""
    make = store_factory(plan.kv, device, plan.kv_block, plan.head_groups, plan.kv_kept)
    probes = _probes(run, plan, consumer) if check and plan.kv in APPROXIMATE else {}

    def kv_store(att):
        store = make(att)
        store.probe = probes.get(att.node)
        return store

    run.kv_store = kv_store
    run.attend_store = store_attend(consumer)
    with phase("phase KV"):
        run.build_kv(plan.chunk)
    held = _host_rows(run) if fill is not None else None   # phase Q lets go of the store: its rows kept
    error = None
    if probes:
        extra, rows = sum(p.nbytes() for p in probes.values()), min(p.rows for p in probes.values())
        worst = {"max_abs": 0.0, "rel": 0.0}
        for node, probe in probes.items():
            store = run.stores[node]
            store.probe = None
            d = probe.error(store)
            worst = {key: max(worst[key], d[key]) for key in worst}
            probe.release()
        error = KVError(plan.kv, worst["rel"], worst["max_abs"], rows, extra)
        probes.clear()
    with phase("phase Q"):
        out = run.run_q(plan.chunk, donate, span=plan.q_span)
    if held is not None:
        store, k, v = held
        store.wait_written()   # (phase Q's copies back waited for them already; a cache reads them on other streams)
        fill(k, v, device)
    return out, error


def _host_rows(run) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The one global attention's store and its K and V as views of its host rows (what a cache filled from them
    takes)."""
    (store,) = run.stores.values()
    kv = store.host_kv()
    if kv is None:   # the planner offers a cache-filling call one host store in one head group alone
        raise RuntimeError(f"streamplan: a {store.kind} store in {store.groups} head group(s) has no host rows to "
                           "fill a cache from")
    return store, *kv


def run_stored(ctx: CallContext, sig: tuple, run, plan, device: torch.device, consumer, donate: dict,
               fill: Callable[[torch.Tensor, torch.Tensor, torch.device], None] | None = None) -> Any:
    """Run a planned L4/L5 call; an approximate store's first call per signature also measures its error
    (``run_with_store``), unless the block writes into its inputs (its Q, built ahead for the check, would read them
    before phase KV changed them). ``fill``: a cache filled from the store's host rows after phase Q."""
    entry = ctx.entry
    measure = plan.kv in APPROXIMATE and sig not in entry.kv_errors and device.type != "meta" and not rehearsing()
    if measure and run.an.input_writes:
        ctx.note(f"kv={plan.kv}: error not measured (the block writes into its inputs)")
        measure = False
    out, error = run_with_store(run, plan, device, consumer, donate, measure, fill)
    if measure and error is None:
        ctx.note(f"kv={plan.kv}: error not measured (no global attention's Q is [batch, heads, rows, head_dim])")
    if error is not None:
        entry.kv_errors[sig] = error
        log.info("streamplan: %s: %s", entry.name or type(entry.module).__name__, error.describe())
    return out


def plan_args(ctx: CallContext, found, rows: int, device: torch.device, consumer, adapted: Any = None,
              spans: bool = False) -> dict:
    """``plan_graph``'s K/V arguments for this call: the stores it may use, the one asked for, and the block's costs.
    A store asked for that this block cannot use is noted and the K/V stay on the device. ``spans``: the block's
    queries may be attended a span of chunks at a time (``kv_options``)."""
    kv = ctx.options.kv
    opts, why = options_for(found, rows, device, kv, consumer, adapted, spans)
    timed = {"costs": costs(found, rows, device)}   # a block with no store is timed too (a masked attention, experts)
    if why is not None or not opts:
        if kv != "device":
            ctx.note(f"kv={kv} not used: {why or 'K/V shapes unknown'}")
        return timed
    return {"kv_options": opts, "kv_store": kv, **timed}


__all__ = ["check_kv", "kv_problem", "span_problem", "cache_bytes", "kv_options", "costs", "options_for", "plan_args",
           "run_stored", "run_with_store", "KVError", "PROBE_ROWS"]
