"""A block streamed from its captured graph (``streamplan.graph``), one call in three stages: the call checked (adapted
to what the graph takes, the graph captured or reused, the attention's consumer asked what it can take), planned
from the graph's memory model under the budget, then run (phase KV, or head groups, then phase Q)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from . import hook_chains as hooks, host_rows, kv_tiers, sequence_parallel as parallel
from ..attention import graph_consumer, lse_attention, unsupported
from ..graph import cache_views, fused_chains as fuse, rows_of_call, rows_problem, running, streamable
from ..graph.autocast_regions import autocast_problem
from ..graph.analyze import numel_besides
from ..graph.memory import graph_memory
from ..graph.opaque_layers import opaque_layers
from ..graph.sliced_mlp import row_dim
from ..graph.work import phase_runs
from ..graph.phases import keepable_outputs
from ..plan.planner import (META_MULTIPROCESSORS, REPLAY_MIN_CHUNKS, ROW_PIECES, SLICED_TIERS, UTILISATION_FLOOR,
                            BudgetError, Plan, Tier, Waves, aligned_chunk, plan_graph)
from ..registries import adapt_call, block_backend, describe_call
from ..specs import AdaptedCall, HostRows, RowMask, described_whole
from .call_ledger import phase
from .call_state import bypass, needs_grad, shapes
from .chunk_attention import ChunkAttention
from .chunk_replay import RECORDS, replay_held_bytes, replay_problem, staged_row_bytes
from .context import CallContext
from .rehearsal import ledger_paused
from .donation import donated
from .graph_run import GraphRun
from .row_contraction_run import grid_chunk
from .part_calls import workspace_bytes, workspace_row_bytes

log = logging.getLogger("streamplan")


@dataclass(eq=False)
class GraphCall:
    """A call the captured graph can take, with what its checks found: what planning and running read."""

    args: tuple                       # as the graph takes them (row mask and cache taken out)
    kwargs: dict
    rows: int
    device: torch.device
    found: Any                        # ``graph.Streamable``: the capture, its analysis and phases
    consumer: Any                     # the attention consumer (across ranks under sequence parallelism)
    par: Any = None                   # ``sequence_parallel.BlockParallel`` or None
    adapted: AdaptedCall | None = None   # a cache taken out of the call, filled from the graph's K/V after it
    row_mask: RowMask | None = None
    whole_problem: str | None = None  # why the attention output cannot be built whole ahead (None: it can)
    whole_q: bool = False             # the consumer takes every query row in one call
    groups: tuple[int, ...] = ()      # head-group counts L3 may use
    donate: dict = field(default_factory=dict)    # output index -> the input tensor it may be written over
    sig: tuple = ()                   # the plan's key: shapes, dtype, device, donation, attention form
    kv_args: dict = field(default_factory=dict)   # the planner's K/V store arguments (``kv_tiers.plan_args``)
    host: dict = field(default_factory=dict)      # L6: id of a host tensor in ``args``/``kwargs`` -> its HostRows
    host_row_bytes: int = 0                       # device bytes per row of the host inputs' chunk copies

    @property
    def attention(self):
        """The block's one global attention, or None (every op row-local: cross-attention, an MLP)."""
        attentions = self.found.analysis.attentions
        return attentions[0] if attentions else None


def run_graph(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    """The graph reads the block's weights directly: hooks on leaves inside it (leaf-level offloading, layerwise
    casting) put them in place first."""
    if not hooks.leaf_hooks(ctx.entry.module):
        return _run_onloaded(ctx, args, kwargs)
    with hooks.onloaded(ctx.entry.module):
        return _run_onloaded(ctx, args, kwargs)


def _run_onloaded(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    with running(ctx.entry.module):   # whose layers the graph's opaque layer ops call (graph.opaque_layers)
        return stream_call(ctx, args, kwargs)


def stream_call(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    """Check the call, plan it, run it; the stock forward wherever a check says why (noted) or the plan is L0."""
    stock = functools.partial(_stock_described, ctx.entry, args, kwargs)   # described inputs built whole
    call = check_call(ctx, args, kwargs)
    if isinstance(call, str):
        if call:
            ctx.note(call)
        return stock()
    plan = ctx.plan(call.sig, functools.partial(plan_call, ctx, call), *host_rows.device_only(
        (call.args, call.kwargs), call.host), call.device)   # host rows are not live on the device
    if plan.tier == Tier.L0:
        return stock()
    return host_rows.rewrapped(run_call(ctx, call, plan), call.host)


# -- stage 1: the call checked -------------------------------------------------------------------------------------

def check_call(ctx: CallContext, args: tuple, kwargs: dict) -> GraphCall | str:
    """The call as the graph takes it, or why it runs stock ("" to run stock without a note)."""
    module = ctx.entry.module
    described = describe_call(module, args, kwargs)   # a value no capture holds, described (a flex BlockMask)
    if isinstance(described, str):
        return f"ran stock: {described}"
    args, kwargs = described if described is not None else (args, kwargs)
    taken = _take_row_mask(args, kwargs)
    if isinstance(taken, str):
        return taken
    row_mask, args, kwargs = taken
    args, kwargs, host = host_rows.taken(args, kwargs)   # L6: rows in host memory, read back chunk by chunk
    viewed = cache_views.viewed(args, kwargs)   # a cache the block only reads: taken as its tensors
    if isinstance(viewed, str):
        return f"ran stock: {viewed}"
    args, kwargs = viewed
    adapted = adapt_call(module, args, kwargs)   # a cache object, say: the call as the graph takes it
    if isinstance(adapted, str):
        return f"ran stock: {adapted}"
    args, kwargs = (adapted.args, adapted.kwargs) if adapted is not None else (args, kwargs)
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rows = rows_of_call(args, kwargs)
    why = _input_problem(module, args, kwargs, tensors, rows)
    if why is not None:
        return why
    chosen = _consumer_for(module, row_mask)
    if isinstance(chosen, str):
        return chosen
    consumer, par = chosen
    with bypass(), parallel.capture_scope(par), ledger_paused():   # the capture traces the stock forwards of any
        #                                                            streamed children; host rows traced where the
        #                                                            block computes
        found, fresh = streamable(module, *host_rows.stand_ins((args, kwargs), host), rows)
    if isinstance(found, str):
        return f"ran stock: {found}"
    if rows < found.captured.min_rows:   # reused from a call with more rows: its trace holds only from that many
        return f"ran stock: {rows} rows, fewer than the {found.captured.min_rows} its capture holds for"
    if not found.captured.holds_for(rows):   # reused from a call with fewer rows: its trace narrowed the count
        return f"ran stock: {rows} rows, more than the {found.captured.max_rows} its capture holds for"
    why = autocast_problem(found.captured.autocast_off)
    if why is not None:
        return f"ran stock: {why}"
    _note_capture(ctx, found, fresh)
    device = next(iter(host.values())).device if host else tensors[0].device
    call = GraphCall(args, kwargs, rows, device, found, consumer, par, adapted, row_mask)
    why = _attention_problem(call)
    if why is not None:
        return why
    _host_inputs(ctx, call, host)
    tensors = [t for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor)]
    # L3 keeps no whole K/V to hand back to a cache; under sequence parallelism head groups would change the exchanges
    call.groups = (head_groups_allowed(found, call.whole_problem)
                   if adapted is None and par is None and not call.whole_q else ())
    if adapted is not None and (len(found.analysis.attentions) != 1
                                or found.analysis.attentions[0].k.meta["val"].shape[1] != adapted.kv_heads):
        return "ran stock: the graph's K/V are not the ones its cache would hold"
    _note_unused_options(ctx, call)
    call.donate = _donation(ctx, module, call, tensors)
    call.sig = _signature(ctx, call, tensors)
    call.kv_args = _kv_arguments(ctx, call)
    return call


def _host_inputs(ctx: CallContext, call: GraphCall, host: dict[int, HostRows]) -> None:
    """Host rows the graph reads chunk by chunk (``call.host``), or, where it cannot, brought to the device whole
    (said in the report): a block that writes into its inputs, exchanges rows across ranks, fills a cache or needs
    every query row at once, or whose host input is not donated (its output would need rows of its own)."""
    if not host:
        return
    an = call.found.analysis
    why = ("it writes into its inputs" if an.input_writes else "under sequence parallelism" if call.par is not None
           else "its K/V go to a cache" if call.adapted is not None else "its attention takes every query row at once"
           if call.whole_q else None)
    kept = [t for t in tree_leaves((call.args, call.kwargs))
            if isinstance(t, torch.Tensor) and isinstance(host.get(id(t)), HostRows)]
    if why is None and kept and not any(donated(t) for t in kept):
        why = "its host input is not donated"
    if why:
        ctx.note(f"its {'rows kept in host memory brought to the device' if kept else 'per-row tables built'} "
                 f"whole: {why}")
        call.args, call.kwargs = host_rows.brought_whole((call.args, call.kwargs), host)
        return
    call.host = host
    rows = call.rows
    call.host_row_bytes = sum(math.prod(h.shape) // rows * h.dtype.itemsize for h in host.values())


def _take_row_mask(args: tuple, kwargs: dict) -> tuple[RowMask | None, tuple, dict] | str:
    """A mask over the rows, described (``specs.RowMask``), taken out of the call: built a Q chunk's rows at a time."""
    masks = [v for v in (*args, *kwargs.values()) if isinstance(v, RowMask)]
    if not masks:
        return None, args, kwargs
    if len(masks) > 1:
        return "ran stock: more than one row mask in a call"
    row_mask = masks[0]
    return (row_mask, tuple(None if v is row_mask else v for v in args),
            {k: (None if v is row_mask else v) for k, v in kwargs.items()})


def _input_problem(module, args: tuple, kwargs: dict, tensors: list, rows: int | None) -> str | None:
    if not tensors:
        return ""
    if needs_grad(module, tensors[0]):
        return "autograd is recording: ran stock (streamed executors are for inference)"
    if rows is None or rows < 2:
        return f"ran stock: {rows_problem(args, kwargs)}"
    hooked = hooks.hooks_added_inside(module)
    if hooked:
        return f"ran stock: {hooked}"
    return None


def _consumer_for(module, row_mask: RowMask | None) -> tuple[Any, Any] | str:
    """(the block's attention consumer, its sequence parallelism or None), or why the block runs stock."""
    backend = block_backend(module)
    consumer = graph_consumer(backend)
    if consumer is None:
        return f"ran stock: attention backend {backend!r} has no streamplan consumer"
    par = parallel.block_parallel(module)   # sequence parallelism: every rank holds its own rows
    if par is not None and par.problem:
        return f"ran stock: {par.problem}"
    if par is not None and row_mask is not None:
        return "ran stock (its mask built whole): a row mask under sequence parallelism"
    return consumer, par


def _note_capture(ctx: CallContext, found, fresh: bool) -> None:
    if not fresh and any(n.startswith("captured") for n in ctx.entry.runtime_notes):
        return
    an, cap = found.analysis, found.captured
    static = f"; {found.static_rows} static rows joined (computed once per phase)" if found.static_rows else ""
    opaque = opaque_layers(ctx.entry.module)
    more = ", ..." if len(opaque) > 1 else ""
    layers = (f"; {len(opaque)} module(s) run whole on each chunk's rows as opaque ops ("
              f"{opaque[0][2].name}: {type(opaque[0][1]).__name__} {opaque[0][0]}{more}): no feature slices"
              ) if opaque else ""
    masks = len(an.built_whole & an.whole_inputs)
    leaves = {n for pm in an.pair_masks.values() for n in pm.leaves} & an.built_whole - an.whole_inputs
    built = (f"; {len(an.built_whole)} value(s) built from the row count once over every row ({masks} key mask(s), "
             f"{len(leaves)} read by masks over rows x rows, {len(an.built_whole) - masks - len(leaves)} read by rows)"
             ) if an.built_whole else ""
    made = len(set(an.pair_masks) & an.whole_inputs)
    pairs = (f"; {len(an.pair_masks) - made} mask(s) over rows x rows built inside the block, each Q chunk's rows "
             f"built alone" if len(an.pair_masks) > made else "") + (
        f"; {made} key mask(s) made inside the block from its inputs, built whole for each Q chunk" if made else "")
    reduced = (f"; {len(an.reduced)} attention(s) of fixed queries over the rows reduced over the chunks (their "
               f"partial outputs merged by log-sum-exp, what reads them run once after)") if an.reduced else ""
    ctx.note(f"captured in {cap.seconds:.2f} s: {an.ops} ops, {len(an.attentions)} global attention(s){static}"
             f"{layers}{built}{pairs}{reduced}")


def _attention_problem(call: GraphCall) -> str | None:
    """Why the consumer cannot take this block's attention as the graph holds it, or None; fills in the attention's
    form (``whole_problem``, ``whole_q``) and, under sequence parallelism, the consumer across the ranks."""
    an, att, consumer = call.found.analysis, call.attention, call.consumer
    if call.row_mask is not None:
        why = _row_mask_problem(an, call.row_mask, call.rows, consumer)
        if why:
            return f"ran stock (its mask built whole): {why}"
    call.whole_problem = whole_output_problem(call.found)   # None: the attention output can be built ahead
    call.whole_q = att is not None and not consumer.caps.bounded_q   # one attention call with every query row
    if call.whole_q:
        why = (call.whole_problem or ("a row mask is built per Q chunk" if call.row_mask is not None else None)
               or ("under sequence parallelism" if call.par is not None else None)
               or ("its K/V go to a cache" if call.adapted is not None else None))
        if why:
            return f"ran stock: attention backend {consumer.name} needs the whole Q in one call, and {why}"
    if att is not None:
        qv, kv = att.q.meta["val"], att.k.meta["val"]
        given = att.mask.meta["val"] if att.mask is not None else None   # a mask input the graph attends with
        why = unsupported(consumer, heads=qv.shape[1], kv_heads=kv.shape[1], head_dim=qv.shape[-1],
                          causal=att.causal, mask=_BOOL_MASK if call.row_mask is not None else given, dtype=qv.dtype,
                          whole_q=call.whole_q, softcap=any(a.softcap for a in an.attentions),
                          sinks=any(a.sinks is not None for a in an.attentions))
        if why:
            return f"ran stock: {why}"
    if call.par is not None and an.reduced:
        return ("ran stock: an attention of fixed queries over the rows, reduced over the chunks, under sequence "
                "parallelism (its partial outputs would have to be merged across the ranks)")
    if call.par is not None and att is not None:   # attention across the ranks' rows: K/V and Q chunks exchanged
        why = parallel.consumer_problem(call.par, an) or ("an attention mask under sequence parallelism"
                                                           if att.mask is not None else None)
        if why:
            return f"ran stock: {why}"
        call.consumer = parallel.consumer(consumer, call.par)
        if any(a.softcap for a in an.attentions) and not call.consumer.caps.softcap:
            return f"ran stock: soft-capped attention through {call.consumer.name}, which does not soft-cap"
        if any(a.sinks is not None for a in an.attentions) and not call.consumer.caps.sinks:
            return f"ran stock: attention sinks through {call.consumer.name}, which does not take them"
    return None


def _note_unused_options(ctx: CallContext, call: GraphCall) -> None:
    """Options the user forced that this block cannot use: said, not silently dropped."""
    o = ctx.options
    if o.head_groups and o.head_groups not in call.groups:
        ctx.note(f"head_groups={o.head_groups} (L3) not used: the graph allows "
                 f"{list(call.groups) or 'none (one global attention without static rows or input writes is needed)'}")
    if o.q_span and (why := kv_tiers.span_problem(call.found)):
        ctx.note(f"q_span={o.q_span} not used: {why}")
    elif o.q_span and o.chunk_tokens is None and o.budget is not None:
        ctx.note(f"q_span={o.q_span} not used: it sets a fixed chunk's span (with chunk_tokens); under a budget the "
                 f"planner picks the span itself")
    if o.kv_block and o.chunk_tokens is None and o.budget is not None:
        ctx.note(f"kv_block={o.kv_block} not used: it sets a fixed chunk's K/V blocks (with chunk_tokens); under a "
                 f"budget the planner picks the block itself")
    align = query_alignment(call)
    if o.chunk_tokens and o.chunk_tokens % align:
        ctx.note(f"chunk_tokens={o.chunk_tokens} rounded to {aligned_chunk(o.chunk_tokens, align)}: chunks start on "
                 f"the {call.consumer.name} consumer's {align}-row query blocks")
    if o.ffn_slice and not call.found.mlp_regions:
        ctx.note("ffn_slice: no linear -> elementwise -> linear MLP found in the graph to slice")


def _donation(ctx: CallContext, module, call: GraphCall, tensors: list) -> dict:
    """The block's input its output may be written over (a model forward donated it), keyed by output index."""
    an = call.found.analysis
    out0 = an.outputs[0] if an.outputs else None
    r0 = an.rows.get(out0) if out0 is not None else None
    if getattr(r0, "dim", None) != 1 or r0.pre + r0.post != 0:   # only an output with the input's rows
        return {}
    if an.halo != (0, 0):   # a later chunk reads its halo of input rows an earlier chunk's output would overwrite
        return {}
    x = next((t for t in tensors if donated(t)), None)
    held = hooks.holding_inputs(module) if x is not None else None
    if held:   # a cache hook compares the block's output with its input: that input must survive
        ctx.note(f"block input not donated: {held} keeps a reference to it")
        return {}
    val = out0.meta["val"]
    if x is not None and x.dim() == val.dim() and x.shape[1] == call.rows and x.dtype == val.dtype:
        return {0: x}
    return {}


def _signature(ctx: CallContext, call: GraphCall, tensors: list) -> tuple:
    """What a plan is kept under: the call's shapes, dtype, device and donation, and the attention's form."""
    sig = (shapes(call.args, call.kwargs), tensors[0].dtype, call.device.type, bool(call.donate))
    if call.host:   # L6: planned apart from the same call with its rows on the device
        sig += ("host rows",)
    if call.whole_q:   # planned apart from chunked-Q calls of the same shapes
        sig += ("whole q",)
    if call.adapted is not None:   # planned apart from the same call without its cache (the fill is priced, and
        # a cache that takes host rows allows a store)
        sig += (("cache", call.adapted.held, call.adapted.host_fill is not None),)
    if call.row_mask is not None and call.row_mask.flex is not None:
        sig += (("flex row mask", call.row_mask.keys),)
        ctx.note(f"its flex BlockMask described over its rows and the {call.row_mask.keys - call.rows} keys after "
                 "them, cut to each Q chunk's query blocks")
    elif call.row_mask is not None:
        sig += (("row mask", call.row_mask.window),)
        ctx.note("its attention mask built a Q chunk's rows at a time, against the keys they can see"
                 + (f" (sliding window of {call.row_mask.window})" if call.row_mask.window else ""))
    return sig


def _kv_arguments(ctx: CallContext, call: GraphCall) -> dict:
    """Where K/V may live between the phases (L4 host, L5 int8/fp8; ``kv_tiers``), as planner arguments."""
    att = call.attention
    kv_args = kv_tiers.plan_args(ctx, call.found, call.rows, call.device, call.consumer, call.adapted,
                                 spans=kv_tiers.span_problem(call.found) is None)
    timed = {"costs": kv_args["costs"]}   # the time model prices every plan; only the stores below may be barred
    if call.par is not None:   # under sequence parallelism K/V live in the exchange buffer (attention.ulysses)
        return timed
    if call.row_mask is not None or (att is not None and att.mask is not None):   # masked chunks attend K/V on the
        return timed                                                               # device (no store takes masks)
    if call.whole_q:   # the one call attends K/V on the device
        return timed
    return kv_args


def query_alignment(call: GraphCall) -> int:
    """Rows every chunk is a multiple of: the attention consumer's query alignment (``ConsumerCaps.q_align``: a flex
    mask's query blocks), 1 where the block has no global attention or one call takes every query row."""
    if call.attention is None or call.whole_q:
        return 1
    return max(1, call.consumer.caps.q_align)


def whole_output_problem(found) -> str | None:
    """Why the captured block's attention output cannot be built whole before phase Q reads its rows (L3, and a
    consumer that needs the whole Q), or None: one global attention, no static rows, Q ``[batch, heads, rows, dim]``."""
    an = found.analysis
    if len(an.attentions) != 1:
        return f"the block has {len(an.attentions)} global attentions, not one"
    if found.static_rows:
        return f"{found.static_rows} static rows are joined to the block's rows"
    if an.halo != (0, 0):   # phase Q's query rows are widened by the halo, chunk by chunk
        return "a convolution along the rows widens each chunk's query rows by its halo"
    att = an.attentions[0]
    if att.q_rows is None or (att.q_rows.pre, att.q_rows.post) != (0, 0) or att.q_rows.dim != 2:
        return "its Q is not [batch, heads, rows, head_dim] over the block's rows alone"
    return None


def head_groups_allowed(found, whole_problem: str | None) -> tuple[int, ...]:
    """Head-group counts L3 can use on a captured block: its attention output built whole (``whole_problem`` None:
    ``whole_output_problem``), no writes into the block's inputs (each group reruns the projections), and groups
    dividing the K/V heads."""
    an = found.analysis
    if whole_problem or an.input_writes or any(a.sinks is not None for a in an.attentions):   # sinks: every head's
        return ()
    if any(a.mask is not None and a.mask.meta["val"].dtype == torch.int32 for a in an.attentions):
        return ()   # flex block tables (``attention.flex.full_block_tables``): every head's, not a group's
    att = an.attentions[0]
    kv_heads, heads = att.k.meta["val"].shape[1], att.q.meta["val"].shape[1]
    if not isinstance(kv_heads, int) or not isinstance(heads, int):
        return ()
    return tuple(g for g in (2, 4, 8, 16, 32, 64) if g <= kv_heads and kv_heads % g == 0 and heads % g == 0)


# -- stage 2: the call planned -------------------------------------------------------------------------------------

def plan_call(ctx: CallContext, call: GraphCall, budget: int | None) -> Plan:
    """The plan for ``budget`` bytes; under sequence parallelism the fullest rank's budget, and the same plan on every
    rank (collectives)."""
    budget = parallel.agreed_budget(budget, call.par, call.device)
    if ctx.options.replay:
        an = call.found.analysis
        why = replay_problem(an, call.par is not None, call.whole_q)
        if why:
            ctx.note(f"chunk replay (replay=True) not for this block: {why}")
    plan = _keep_or_rerun(call, ctx.options, budget)
    if plan.tier != Tier.L0:   # rows on a grid: chunks of whole lines (rounded down, priced at the larger chunk)
        plan.chunk = grid_chunk(call.found.captured, plan.chunk)
    if ctx.options.replay and plan.tier != Tier.L0 and not plan.replay and replay_row(call, ctx.options) is not None:
        chunks = -(-plan.rows // max(plan.chunk, 1))
        why = (f"its {chunks} chunks are fewer than the {REPLAY_MIN_CHUNKS} a replay needs"
               if plan.tier in (Tier.L1, Tier.L2) and plan.kv == "device" else
               "a replay runs L1 and L2 plans with K/V on the device, their head groups not forced")
        ctx.note(f"chunk replay (replay=True) not used by this plan ({plan.describe(figures=False)}): {why}")
    parallel.agreed_plan(ctx.entry.name or type(ctx.entry.module).__name__, plan, call.par, call.device)
    return plan


def _keep_or_rerun(call: GraphCall, o, budget: int | None) -> Plan:
    """Where a later attention's phase KV runs an earlier one (its K/V read that attention's output): the plan that
    attends it again in phase Q, or the one that keeps its output whole from phase KV (its rows' bytes held for the
    call, its attention run once), whichever the time model says is faster; with no time model (the CPU) the kept
    one where a byte budget holds it, none asked for fixed chunks (the least memory)."""
    plan = plan_for_budget(call, o, budget)
    keep = keepable_outputs(call.found.analysis, call.found.phases)
    if not keep or plan.tier in (Tier.L0, Tier.L3) or plan.q == "whole" or budget is None or call.par is not None:
        return plan
    try:
        kept = plan_for_budget(call, o, budget, tuple(keep))
    except BudgetError:
        return plan
    if kept.tier in (Tier.L0, Tier.L3) or kept.q == "whole":
        return plan
    faster = (kept.predicted_time_ratio < plan.predicted_time_ratio
              if kept.predicted_time_ratio is not None and plan.predicted_time_ratio is not None else True)
    return kept if faster else plan


@dataclass
class AttentionCosts:
    """What a chunk's global attention adds to the memory model, as functions of the chunk's rows."""

    waves: Waves = field(default_factory=Waves)
    workspace: Callable[[int], int] = lambda c: 0   # the consumer's own allocations while it attends
    mask_bytes: Callable[[int], int] = lambda c: 0  # a chunk's mask rows (described, or a given mask's copy)
    attn_out: int = 0                               # the whole attention output (L3, a whole-Q consumer)


def attention_costs(call: GraphCall) -> AttentionCosts:
    att, device, rows = call.attention, call.device, call.rows
    if att is None:
        return AttentionCosts()
    qv, kv = att.q.meta["val"], att.k.meta["val"]
    costs = AttentionCosts()
    if device.type == "cuda":
        costs.waves = Waves(torch.cuda.get_device_properties(device).multi_processor_count, qv.shape[0] * qv.shape[1])
    elif device.type == "meta":   # planning for the device whose rates the estimates use
        costs.waves = Waves(META_MULTIPROCESSORS, qv.shape[0] * qv.shape[1])
    # the consumer's own allocations, charged while the chunk's attention runs (its Q chunk and static rows against
    # every key)
    # sinks are merged with a log-sum-exp the consumer computes as for a masked chunk (fp32 math in pieces)
    q_static = att.q_rows.pre + att.q_rows.post if att.q_rows is not None else 0
    keys = rows + att.kv_rows.pre + att.kv_rows.post
    # (keys and batch: for a consumer that declares per-row bytes over every key, flex's uncompiled scores)
    spec = SimpleNamespace(heads=qv.shape[1], kv_heads=kv.shape[1], head_dim=qv.shape[-1], causal=att.causal,
                           mask=call.row_mask if att.sinks is None else (call.row_mask or "sinks"),
                           device_type=device.type, softcap=att.softcap, keys=keys, batch=qv.shape[0])
    costs.workspace = functools.partial(_workspace, call.consumer, spec, qv.element_size(), rows, q_static, keys)
    if call.row_mask is not None:   # each Q chunk's mask rows (or its per-element pieces): in the transient
        elem = qv.element_size()
        causal_ws = workspace_row_bytes(call.consumer, SimpleNamespace(
            heads=qv.shape[1], head_dim=qv.shape[-1], causal=True, mask=None, device_type=device.type),
            elem) if call.row_mask.spans is not None else 0
        costs.mask_bytes = functools.partial(_row_mask_bytes, call.row_mask, elem, qv.shape[1] * qv.shape[-1] * elem,
                                             causal_ws, rows)
    elif att.mask_query_rows:   # a given mask's chunk rows are views; the kernel's additive copy is not, nor are a
        # mask built inside the block's chunk rows (``pair_masks``)
        pm = call.found.analysis.pair_masks.get(att.mask)
        at = functools.partial(call.found.captured.size_at, rows=rows)
        built = functools.partial(pm.chunk_bytes, at) if pm else None
        costs.mask_bytes = functools.partial(_given_mask_bytes, att.mask.meta["val"], qv.element_size(), rows,
                                             built=built)
    held, making = _consumer_mask_bytes(call.consumer, att)
    if held or making:   # the consumer's own form of the graph's mask (flex's tables unpacked): kept for phase Q
        costs.mask_bytes = functools.partial(_plus, costs.mask_bytes, held)
        costs.workspace = functools.partial(_at_least, costs.workspace, making - held)
    out_val = att.node.meta["val"]
    if call.groups or call.whole_q:
        costs.attn_out = numel_besides(out_val, 2) * rows * out_val.element_size()
    return costs


def plan_for_budget(call: GraphCall, o, budget: int | None, keep: tuple = ()) -> Plan:
    """The graph's memory model (whole buffers, a chunk's worst moment) and the attention's costs, for the planner;
    ``keep``: attentions whose output phase KV keeps whole (``_keep_or_rerun``)."""
    found, rows, an = call.found, call.rows, call.found.analysis
    regions = found.mlp_regions
    given = o.row_pieces or 1   # the user's pieces, else whole chunks and the planner may try ``ROW_PIECES``
    mem = graph_memory(an, found.phases, rows, set(call.donate), given, keep)
    order = [n for n in found.captured.graph.nodes if n.op == "call_function" and n not in an.ignored]
    costs = attention_costs(call)
    ws, mask_bytes = costs.workspace, costs.mask_bytes
    att = call.attention
    q_whole = 0
    if call.whole_q:
        qv = att.q.meta["val"]
        q_whole = numel_besides(qv, 2) * rows * qv.element_size() + costs.attn_out

    def host_in(c: int) -> int:   # L6: a chunk's rows of the host inputs, copied to the device
        return call.host_row_bytes * min(c, rows)

    def priced(pieces: int) -> tuple[Callable[[int, int], int], Callable[[int, int, int], int]]:
        """One chunk's transients with the row-local runs in ``pieces`` pieces, from the memory model the executor's
        run is priced by (``graph_memory(..., pieces)``)."""
        m = mem if pieces == given else graph_memory(an, found.phases, rows, set(call.donate), pieces, keep)

        def transient(c: int, sl: int) -> int:   # a whole-Q call: its workspace for every row, not the chunk's
            if call.whole_q:
                return max(m.transient(c, sl, regions), ws(rows))
            wide = min(rows, c + sum(an.halo))   # a chunk runs on its rows and their halo
            return m.transient(wide, sl, regions, workspace=ws(c)) + mask_bytes(c) + host_in(wide)

        def transient_kv(c: int, sl: int, extra: int) -> int:
            return m.transient(c, sl, regions, extra, ws(c)) + mask_bytes(c) + host_in(c)

        return transient, transient_kv

    transient, transient_kv = priced(given)
    pieces = ROW_PIECES if o.row_pieces is None and phase_runs(found) else ()
    # a cache the call fills: what it adds once phase Q is done (stock fills it as its attention runs: beside its peak)
    fill, fill_host = kv_tiers.cache_bytes(call.adapted, mem.kv_bytes)
    kv_args = call.kv_args
    if keep and kv_args.get("costs") is not None and kv_args["costs"].work is not None:   # attended once
        work = dataclasses.replace(kv_args["costs"].work, attention_rerun_flops=0.0)
        kv_args = {**kv_args, "costs": dataclasses.replace(kv_args["costs"], work=work)}
    plan = plan_graph(rows, mem.fixed, transient,
                      # stock's one call has its workspace too, and its host rows brought whole
                      mem.stock(order) + mask_bytes(rows) + ws(rows) + host_in(rows) + _eager_scores(an, rows) + fill,
                      chunk_tokens=o.chunk_tokens, budget=budget,
                      min_chunk=UTILISATION_FLOOR.get(call.device.type, 0), waves=costs.waves,
                      ffn=max((r.ffn for r in regions), default=0), ffn_slice=o.ffn_slice,
                      kv=mem.kv_bytes - mem.build_inputs, attn_out=costs.attn_out, groups=call.groups,
                      head_groups=o.head_groups,
                      transient_kv=transient_kv, whole_q=q_whole, q_span=o.q_span, kv_block=o.kv_block,
                      row_pieces=given, pieces=pieces,
                      priced=priced, fill=fill, fill_host=fill_host, align=query_alignment(call),
                      replay_row=replay_row(call, o), replay_held=replay_held_bytes(call.device),
                      replay=o.replay, **kv_args)
    plan.kept_outputs = bool(keep) and plan.tier != Tier.L0
    return plan


def replay_row(call: GraphCall, o) -> int | None:
    """Device bytes per row a replayed chunk of this call stages (``chunk_replay``); None where its chunks cannot be
    replayed, or the user said no, or (left to the planner) the device records no graphs."""
    if o.replay is False or (o.replay is None and call.device.type not in RECORDS):
        return None
    an = call.found.analysis
    if replay_problem(an, call.par is not None, call.whole_q):
        return None
    return staged_row_bytes(an, call.found.captured.graph)


# -- stage 3: the call run -----------------------------------------------------------------------------------------

def run_call(ctx: CallContext, call: GraphCall, plan: Plan) -> Any:
    """Phase KV (K/V whole on the device, in a store, or the attention output by head groups), then phase Q."""
    o, found, att = ctx.options, call.found, call.attention
    attend = ChunkAttention(call.consumer, call.row_mask)
    stores = {}
    if call.par is not None:   # K/V of every rank's rows for this rank's heads, exchanged chunk by chunk
        consumer = call.consumer
        stores = dict(kv_store=lambda att: consumer.store(call.device), attend_store=consumer.attend_store)
        if not any(n.startswith("streams under") for n in ctx.entry.runtime_notes):
            ctx.note(f"streams under {call.par.label}: attention through {consumer.name}")
    if plan.tier in SLICED_TIERS and any(row_dim(r, found.analysis) is None for r in found.mlp_regions):
        ctx.note("an MLP sliced by hidden features (it reads a size, or has static rows): its partial products "
                 "accumulated, one rounding a slice (row pieces, elsewhere, are stock's rows exactly)")
    fuse_on = call.device if o.fuse or (o.fuse is None and fuse.available(call.device)) else None

    keep = tuple(keepable_outputs(found.analysis, found.phases)) if plan.kept_outputs else ()

    def graph_run(ffn_slice: int, fuse_rows: int, **extra) -> GraphRun:
        return GraphRun(found.captured, found.analysis, found.phases, ctx.entry.module, call.args, call.kwargs,
                        call.rows, attend, ffn_slice=ffn_slice, regions=found.mlp_regions,
                        pieces=o.row_pieces or plan.row_pieces,
                        fuse=fuse_on, fuse_rows=fuse_rows, host=call.host, keep=keep,
                        attend_lse=lse_attention(call.consumer), replay=plan.replay, **extra)

    run = graph_run(plan.ffn_slice if plan.tier in SLICED_TIERS else 0, 0 if o.fuse else plan.chunk, **stores)
    if call.par is not None:
        run.no_retries()   # a chunk retried alone would leave the other ranks waiting in its exchanges
    if plan.kv != "device" and run.kv_store is None:   # L4/L5: K/V into a store, attended block by block (a cache
        # filled from it takes its host rows: the planner offers a store to no other cache)
        fill = call.adapted.host_fill if call.adapted is not None else None
        out = kv_tiers.run_stored(ctx, call.sig, run, plan, call.device, call.consumer, call.donate, fill)
        _note_chains(ctx.note, run)
        return out
    if plan.tier == Tier.L3 or plan.q == "whole":   # the attention output whole, read by rows in phase Q
        with phase("phase KV + attention"):
            run.build_grouped(plan.chunk, plan.head_groups, whole_q=plan.q == "whole")
    else:
        with phase("phase KV"):
            run.build_kv(plan.chunk)
    kv = run.kv[att.node] if call.adapted is not None else None   # phase Q lets go of its buffers: keep them
    with phase("phase Q"):
        out = run.run_q(plan.chunk, call.donate)
    _note_chains(ctx.note, run)
    for why in dict.fromkeys(run.replay_problems):
        ctx.note(f"chunk replay off for a call: its recording failed ({why}); its chunks ran eager")
    if kv is not None:
        call.adapted.fill(*kv)
    return out


_BOOL_MASK = torch.empty(0, dtype=torch.bool)



def _note_chains(note: Callable[[str], None], run: GraphRun) -> None:
    """What the report says of the call's element-wise chains (how many ran compiled, and each kept eager, why) and
    of its projections run for the columns their phase reads."""
    for p in run.prunings:   # (one that ran for its features alone is the plan working: the log says so)
        width = int(p.linear.meta["val"].shape[-1])
        verdicts = set(p.checked.values())
        if True in verdicts:
            log.debug("streamplan: a projection (%s) ran for the %d of its %d output features a phase reads, exact "
                      "(checked bit for bit on a first chunk)", p.linear.name, p.hi - p.lo, width)
        if False in verdicts:
            note(f"a projection ({p.linear.name}) ran whole: its {p.hi - p.lo} features alone differed from the "
                 f"whole projection's on a first chunk")
    if run.fuse is None or not run.chains:
        return
    states = [(c, fuse.state(c, run.fuse)) for c in run.chains]
    done = sum(1 for _, s in states if s is not None and s.ok)
    if done:
        note(f"{done} chain(s) of element-wise ops each ran as one compiled kernel, exact (checked bit "
             f"for bit against their eager ops on a first chunk)")
    for c, s in states:
        if s is not None and s.ok is False:
            note(f"a chain of {c.ops} ran eager: {s.why}")


def _consumer_mask_bytes(consumer, att) -> tuple[int, int]:
    """(bytes kept through phase Q, most allocated at once while making them) for the consumer's own form of the
    graph's mask input, as it declares (``graph_mask_bytes``; (0, 0) where it declares none)."""
    declare = getattr(consumer, "graph_mask_bytes", None)
    mask = att.mask.meta.get("val") if att.mask is not None else None
    if declare is None or not isinstance(mask, torch.Tensor):
        return 0, 0
    return declare(mask)


def _plus(per_chunk: Callable[[int], int], held: int, chunk: int) -> int:
    return per_chunk(chunk) + held


def _at_least(per_chunk: Callable[[int], int], least: int, chunk: int) -> int:
    return max(per_chunk(chunk), least)


def _workspace(consumer, call, elem: int, rows: int, q_static: int, keys: int, chunk: int) -> int:
    return workspace_bytes(consumer, call, elem, min(chunk, rows) + q_static, keys)


EAGER_SCORES_HELD = 3   # score tensors over rows x keys a hand-written attention holds at once in stock (measured on
#                        CPU, 2026-12-05, 2,048 rows: Gemma 2's layer 2, GPT-OSS's with its sinks 3; Python's names keep
#                        the chain's earlier values alive, which its graph does not show)


def _eager_scores(an, rows: int) -> int:
    """Stock runs a hand-written attention as written (``graph.eager_attention`` found it): its scores over every
    query row and key, fp32, several at once; the fused op the graph holds instead shows none of them."""
    total = 0
    for att in an.attentions:
        if att.node.target is torch.ops.streamplan.eager_attention.default:
            qv = att.q.meta["val"]
            lead = 1
            for size in qv.shape[:-2]:
                lead *= size if isinstance(size, int) else 1
            q_rows = rows + (att.q_rows.pre + att.q_rows.post if att.q_rows is not None else 0)
            total += EAGER_SCORES_HELD * lead * q_rows * (rows + att.kv_rows.pre + att.kv_rows.post) * 4
    return total


def _given_mask_bytes(mask, elem: int, rows: int, chunk: int, built: Callable[[int], int] | None = None) -> int:
    """Per chunk of a mask over rows x rows: the kernel's additive copy of its rows, and where the block builds the
    mask, the chunk rows it builds (``built``)."""
    keys = mask.shape[-1]
    lead = 1
    for size in mask.shape[:-2]:
        lead *= size if isinstance(size, int) else 1
    return lead * min(chunk, rows) * (keys if isinstance(keys, int) else rows) * elem + (built(chunk) if built else 0)


def _row_mask_bytes(row_mask: RowMask, elem: int, row_bytes: int, causal_ws: int, rows: int, chunk: int) -> int:
    return row_mask.chunk_bytes(chunk, elem, row_bytes) + causal_ws * min(chunk, rows)


def _stock_described(entry, args: tuple, kwargs: dict) -> Any:
    """The stock call with its described inputs built whole (row masks as the library builds them, host rows on the
    device)."""
    args, kwargs = described_whole(args, kwargs)
    return entry.stock(*args, **kwargs)


def _row_mask_problem(an, row_mask: RowMask, rows: int, consumer) -> str | None:
    """Why a described mask cannot stand for the mask this graph's attention was captured without, or None: the graph
    must have one global attention, with no mask input, over the call's rows alone (a flex mask: the rows, then the
    static keys it describes after them, through the flex consumer)."""
    if len(an.attentions) != 1:
        return f"a row mask for a graph with {len(an.attentions)} global attentions"
    att = an.attentions[0]
    after = row_mask.keys - rows if row_mask.flex is not None else 0
    # captured with no mask, the attention is causal (SDPA's is_causal: the row mask replaces that rule) or attends
    # every key (eager's, hand-written: the row mask is its whole rule); either way the row mask is what it lacks
    if att.mask is not None or (att.kv_rows.pre, att.kv_rows.post) != (0, after) or att.q_rows is None or (
            att.q_rows.pre, att.q_rows.post) != (0, 0) or (att.causal and row_mask.flex is not None):
        return "a row mask for an attention that takes a mask of its own or is not over the call's rows alone"
    if row_mask.rows != rows or (row_mask.flex is None and row_mask.keys != rows):
        return f"a row mask of {row_mask.rows} x {row_mask.keys} rows for a call of {rows}"
    if row_mask.flex is not None and "flex" not in consumer.caps.masks:
        return f"a flex mask for a block whose attention consumer ({consumer.name}) takes none"
    return None
