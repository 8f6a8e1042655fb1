"""Handler for a block streamed from its captured graph (``streamplan.graph``): the call checked and adapted, the
graph captured (or reused), planned from the graph's memory model, then run phase KV (or head groups) and phase Q."""
from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from . import hook_chains as hooks, kv_tiers, sequence_parallel as parallel
from .call_state import bypass, needs_grad, shapes
from ..attention import graph_consumer, unsupported
from .donation import donated
from ..specs import RowMask, row_masks_whole
from ..registries import adapt_call, block_backend
from ..plan.planner import META_MULTIPROCESSORS, SLICED_TIERS, UTILISATION_FLOOR, Plan, Tier, Waves, plan_graph
from ..graph import fused_chains as fuse
from .part_calls import workspace_bytes, workspace_row_bytes


def run_graph(handle, entry, args: tuple, kwargs: dict) -> Any:
    """The graph reads the block's weights directly: hooks on leaves inside it (leaf-level offloading, layerwise
    casting) put them in place first."""
    if not hooks.leaf_hooks(entry.module):
        return _run_onloaded(handle, entry, args, kwargs)
    with hooks.onloaded(entry.module):
        return _run_onloaded(handle, entry, args, kwargs)


def whole_output_problem(found) -> str | None:
    """Why the captured block's attention output cannot be built whole before phase Q reads its rows (L3, and a
    consumer that needs the whole Q), or None: one global attention, no static rows, Q ``[batch, heads, rows, dim]``."""
    an = found.analysis
    if len(an.attentions) != 1:
        return f"the block has {len(an.attentions)} global attentions, not one"
    if found.static_rows:
        return f"{found.static_rows} static rows are joined to the block's rows"
    att = an.attentions[0]
    if att.q_rows is None or (att.q_rows.pre, att.q_rows.post) != (0, 0) or att.q_rows.dim != 2:
        return "its Q is not [batch, heads, rows, head_dim] over the block's rows alone"
    return None


def head_groups_allowed(found, whole_problem: str | None) -> tuple[int, ...]:
    """Head-group counts L3 can use on a captured block: its attention output built whole (``whole_problem`` None:
    ``whole_output_problem``), no writes into the block's inputs (each group reruns the projections), and groups
    dividing the K/V heads."""
    an = found.analysis
    if whole_problem or an.input_writes:
        return ()
    att = an.attentions[0]
    kv_heads, heads = att.k.meta["val"].shape[1], att.q.meta["val"].shape[1]
    if not isinstance(kv_heads, int) or not isinstance(heads, int):
        return ()
    return tuple(g for g in (2, 4, 8, 16, 32, 64) if g <= kv_heads and kv_heads % g == 0 and heads % g == 0)


def _run_onloaded(handle, entry, args: tuple, kwargs: dict) -> Any:
    from ..graph import running
    with running(entry.module):   # whose layers the graph's opaque layer ops call (capture.opaque_layers)
        return _run_graph(handle, entry, args, kwargs)


def _run_graph(handle, entry, args: tuple, kwargs: dict) -> Any:
    from ..graph import rows_of_call, rows_problem, streamable
    from ..graph.opaque_layers import opaque_layers
    from .graph_run import GraphRun
    from ..graph.sliced_mlp import row_dim
    from ..graph.analyze import numel_besides
    from ..graph.memory import graph_memory

    module = entry.module
    stock = functools.partial(entry.stock, *args, **kwargs)
    row_mask = None
    masks = [v for v in (*args, *kwargs.values()) if isinstance(v, RowMask)]
    if masks:   # a mask over the rows, described: built whole for a stock call, a Q chunk's rows at a time here
        stock = functools.partial(_stock_masked, entry, args, kwargs)
        if len(masks) > 1:
            handle.note(entry, "ran stock: more than one row mask in a call")
            return stock()
        row_mask = masks[0]
        args = tuple(None if v is row_mask else v for v in args)
        kwargs = {k: (None if v is row_mask else v) for k, v in kwargs.items()}
    adapted = adapt_call(module, args, kwargs)   # a cache object, say: the call as the graph takes it
    if isinstance(adapted, str):
        handle.note(entry, f"ran stock: {adapted}")
        return stock()
    args, kwargs = (adapted.args, adapted.kwargs) if adapted is not None else (args, kwargs)
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        return stock()
    if needs_grad(module, tensors[0]):
        handle.note(entry, "autograd is recording: ran stock (streamed executors are for inference)")
        return stock()
    rows = rows_of_call(args, kwargs)
    if rows is None or rows < 2:
        handle.note(entry, f"ran stock: {rows_problem(args, kwargs)}")
        return stock()
    hooked = hooks.hooks_added_inside(module)
    if hooked:
        handle.note(entry, f"ran stock: {hooked}")
        return stock()
    backend = block_backend(module)
    consumer = graph_consumer(backend)
    if consumer is None:
        handle.note(entry, f"attention backend {backend!r} has no streamplan consumer: ran stock")
        return stock()
    par = parallel.block_parallel(module)   # sequence parallelism: every rank holds its own rows
    if par is not None and par.problem:
        handle.note(entry, f"ran stock: {par.problem}")
        return stock()
    if par is not None and row_mask is not None:
        handle.note(entry, "ran stock (its mask built whole): a row mask under sequence parallelism")
        return stock()
    with bypass(), parallel.capture_scope(par):   # the capture traces the stock forwards of any streamed children
        found, fresh = streamable(module, args, kwargs, rows)
    if isinstance(found, str):
        handle.note(entry, f"ran stock: {found}")
        return stock()
    an, cap = found.analysis, found.captured
    if fresh or not any(n.startswith("captured") for n in entry.runtime_notes):
        static = f"; {found.static_rows} static rows joined (computed once per phase)" if found.static_rows else ""
        opaque = opaque_layers(module)
        layers = (f"; {len(opaque)} layer(s) run whole on each chunk's rows as opaque ops ("
                  f"{type(opaque[0][1]).__name__} {opaque[0][0]}, ...): no feature slices") if opaque else ""
        handle.note(entry, f"captured in {cap.seconds:.2f} s: {an.ops} ops, {len(an.attentions)} global "
                    f"attention(s){static}{layers}")
    att = an.attentions[0] if an.attentions else None   # none: every op row-local (cross-attention, an MLP)
    if row_mask is not None:
        why = _row_mask_problem(an, row_mask, rows)
        if why:
            handle.note(entry, f"ran stock (its mask built whole): {why}")
            return stock()
    whole_problem = whole_output_problem(found)   # None: the attention output can be built ahead, read by rows
    whole_q = att is not None and not consumer.caps.bounded_q   # one attention call with every query row
    if whole_q:
        why = (whole_problem or ("a row mask is built per Q chunk" if row_mask is not None else None)
               or ("under sequence parallelism" if par is not None else None)
               or ("its K/V go to a cache" if adapted is not None else None))
        if why:
            handle.note(entry, f"ran stock: attention backend {consumer.name} needs the whole Q in one call, and {why}")
            return stock()
    if att is not None:
        qv, kv_ = att.q.meta["val"], att.k.meta["val"]
        given = att.mask.meta["val"] if att.mask is not None else None   # a mask input the graph attends with
        why = unsupported(consumer, heads=qv.shape[1], kv_heads=kv_.shape[1], head_dim=qv.shape[-1],
                          causal=att.causal, mask=_BOOL_MASK if row_mask is not None else given, dtype=qv.dtype,
                          whole_q=whole_q, softcap=any(a.softcap for a in an.attentions))
        if why:
            handle.note(entry, f"ran stock: {why}")
            return stock()
    if par is not None and att is not None:   # attention across the ranks' rows: K/V and Q chunks exchanged
        why = parallel.consumer_problem(par, an) or ("an attention mask under sequence parallelism"
                                                      if att.mask is not None else None)
        if why:
            handle.note(entry, f"ran stock: {why}")
            return stock()
        consumer = parallel.consumer(consumer, par)
        if any(a.softcap for a in an.attentions) and not consumer.caps.softcap:
            handle.note(entry, f"ran stock: soft-capped attention through {consumer.name}, which does not soft-cap")
            return stock()
    o = handle.options
    regions = found.mlp_regions
    # L3 keeps no whole K/V to hand back to a cache; under sequence parallelism head groups would change the exchanges
    groups = head_groups_allowed(found, whole_problem) if adapted is None and par is None and not whole_q else ()
    if adapted is not None and (len(an.attentions) != 1 or an.attentions[0].k.meta["val"].shape[1]
                                != adapted.kv_heads):
        handle.note(entry, "ran stock: the graph's K/V are not the ones its cache would hold")
        return stock()
    if o.head_groups and o.head_groups not in groups:
        handle.note(entry, f"head_groups={o.head_groups} (L3) not used: the graph allows "
                    f"{list(groups) or 'none (one global attention without static rows or input writes is needed)'}")
    if o.q_span and whole_problem:
        handle.note(entry, f"q_span={o.q_span} not used: {whole_problem}")
    elif o.q_span and o.chunk_tokens is None and o.budget is not None:
        handle.note(entry, f"q_span={o.q_span} not used: it sets a fixed chunk's span (with chunk_tokens); under a "
                    f"budget the planner picks the span itself")
    if o.ffn_slice and not regions:
        handle.note(entry, "ffn_slice: no linear -> elementwise -> linear MLP found in the graph to slice")
    donate = {}
    out0 = an.outputs[0] if an.outputs else None
    r0 = an.rows.get(out0) if out0 is not None else None
    if getattr(r0, "dim", None) == 1 and r0.pre + r0.post == 0:   # the output has the input's rows: donate
        x = next((t for t in tensors if donated(t)), None)
        held = hooks.holding_inputs(module) if x is not None else None
        if held:   # a cache hook compares the block's output with its input: that input must survive
            handle.note(entry, f"block input not donated: {held} keeps a reference to it")
            x = None
        val = out0.meta["val"]
        if x is not None and x.dim() == val.dim() and x.shape[1] == rows and x.dtype == val.dtype:
            donate[0] = x
    device = tensors[0].device
    sig = (shapes(args, kwargs), tensors[0].dtype, device.type, bool(donate))
    if whole_q:   # planned apart from chunked-Q calls of the same shapes
        sig += ("whole q",)
    if row_mask is not None:
        sig += (("row mask", row_mask.window),)
        handle.note(entry, "its attention mask built a Q chunk's rows at a time, against the keys they can see"
                    + (f" (sliding window of {row_mask.window})" if row_mask.window else ""))

    # where K/V may live between the phases (L4 host, L5 int8/fp8; ``kv_tiers``), as planner arguments
    kv_args = kv_tiers.plan_args(handle, entry, found, rows, device, consumer, adapted,
                                 spans=whole_problem is None)
    if par is not None:   # under sequence parallelism K/V live in the exchange buffer (consumers.ulysses)
        kv_args = {}
    if row_mask is not None or (att is not None and att.mask is not None):   # masked chunks attend K/V on the
        kv_args = {}                                                          # device (no store takes their masks yet)
    if whole_q:   # the one call attends K/V on the device
        kv_args = {}

    def make_plan(budget: int | None) -> Plan:
        budget = parallel.agreed_budget(budget, par, device)   # the fullest rank's (collective under CP)
        plan = plan_for_budget(budget)
        parallel.agreed_plan(entry.name or type(module).__name__, plan, par, device)
        return plan

    def plan_for_budget(budget: int | None) -> Plan:
        mem = graph_memory(an, found.phases, rows, set(donate), o.row_pieces)
        order = [n for n in cap.graph.nodes if n.op == "call_function" and n not in an.ignored]
        waves, ws, attn_out, mask_bytes = Waves(), (lambda c: 0), 0, (lambda c: 0)
        if att is not None:
            if device.type == "cuda":
                waves = Waves(torch.cuda.get_device_properties(device).multi_processor_count,
                              qv.shape[0] * qv.shape[1])
            elif device.type == "meta":   # planning for the H200, whose rates the estimates use
                waves = Waves(META_MULTIPROCESSORS, qv.shape[0] * qv.shape[1])
            # the consumer's own allocations, charged while the chunk's attention runs (its Q chunk and static rows
            # against every key)
            call = SimpleNamespace(heads=qv.shape[1], kv_heads=kv_.shape[1], head_dim=qv.shape[-1], causal=att.causal,
                                   mask=row_mask, device_type=device.type, softcap=att.softcap)
            q_static = att.q_rows.pre + att.q_rows.post if att.q_rows is not None else 0
            keys = rows + att.kv_rows.pre + att.kv_rows.post
            ws = functools.partial(_workspace, consumer, call, qv.element_size(), rows, q_static, keys)
            if row_mask is not None:   # each Q chunk's mask rows (or its per-element pieces): in the transient
                elem = qv.element_size()
                causal_ws = workspace_row_bytes(consumer, SimpleNamespace(
                    heads=qv.shape[1], head_dim=qv.shape[-1], causal=True, mask=None, device_type=device.type),
                    elem) if row_mask.spans is not None else 0
                mask_bytes = functools.partial(_row_mask_bytes, row_mask, elem, qv.shape[1] * qv.shape[-1] * elem,
                                               causal_ws, rows)
            elif att.mask_query_rows:   # a given mask's chunk rows are views; the kernel's additive copy is not
                mask_bytes = functools.partial(_given_mask_bytes, given, qv.element_size(), rows)
            out_val = att.node.meta["val"]
            attn_out = numel_besides(out_val, 2) * rows * out_val.element_size() if groups or whole_q else 0
        q_whole = numel_besides(qv, 2) * rows * qv.element_size() + attn_out if whole_q else 0

        def transient(c: int, sl: int) -> int:   # a whole-Q call: its workspace for every row, not the chunk's
            if whole_q:
                return max(mem.transient(c, sl, regions), ws(rows))
            return mem.transient(c, sl, regions, workspace=ws(c)) + mask_bytes(c)

        return plan_graph(rows, mem.kv_bytes + mem.out_bytes, transient,
                          mem.stock(order) + mask_bytes(rows) + ws(rows),   # stock's one call has its workspace too
                          chunk_tokens=o.chunk_tokens, budget=budget,
                          min_chunk=UTILISATION_FLOOR.get(device.type, 0), waves=waves,
                          ffn=max((r.ffn for r in regions), default=0), ffn_slice=o.ffn_slice,
                          kv=mem.kv_bytes, attn_out=attn_out, groups=groups, head_groups=o.head_groups,
                          transient_kv=lambda c, sl, extra: (mem.transient(c, sl, regions, extra, ws(c))
                                                             + mask_bytes(c)),
                          whole_q=q_whole, q_span=o.q_span, **kv_args)

    plan = handle.plan_for(entry, sig, make_plan, args, kwargs, device)
    if plan.tier == Tier.L0:
        return stock()

    def attend(q, k, v, *, q_offset, causal, scale, mask=None, softcap=0.0):
        cap = {"softcap": softcap} if softcap else {}   # soft-capped scores (hand-written attention): said only then
        if row_mask is None:   # a mask the block was given: its chunk rows (or whole, over the keys alone)
            return consumer.attend(q, k, v, q_offset=q_offset, causal=causal, mask=mask, scale=scale, **cap)
        # the chunk's mask rows against the keys it can see: built here, for these rows alone
        a, b = q_offset, q_offset + q.shape[-2]
        if row_mask.spans is not None:   # padding and causality: each batch element's keys without a mask
            return _attend_spans(consumer, row_mask, q, k, v, a, scale, cap, mean_of)
        lo, hi = row_mask.span(a, b)
        part = row_mask.part(a, b, lo, hi)
        out = consumer.attend(q, k[..., lo:hi, :], v[..., lo:hi, :], q_offset=a - lo, causal=False, mask=part,
                              scale=scale, **cap)
        if row_mask.blind_rows_see_all:
            out = _blind_rows_see_all(out, part, v, mean_of)
        return out

    mean_of: dict = {}   # V's mean over every key, once per call (eager masks' rows that see no key)

    stores = {}
    if par is not None:   # K/V of every rank's rows for this rank's heads, exchanged chunk by chunk
        stores = dict(kv_store=lambda att: consumer.store(device), attend_store=consumer.attend_store)
        if not any(n.startswith("streams under") for n in entry.runtime_notes):
            handle.note(entry, f"streams under {par.label}: attention through {consumer.name}")
    if plan.tier in SLICED_TIERS and any(row_dim(r, an) is None for r in regions):
        handle.note(entry, "an MLP sliced by hidden features (it reads a size, or has static rows): its partial "
                    "products accumulated, one rounding a slice (row pieces, elsewhere, are stock's rows exactly)")
    fuse_on = device if o.fuse or (o.fuse is None and fuse.available(device)) else None
    run = GraphRun(cap, an, found.phases, module, args, kwargs, rows, attend,
                   ffn_slice=plan.ffn_slice if plan.tier in SLICED_TIERS else 0, regions=regions,
                   pieces=o.row_pieces, fuse=fuse_on, fuse_rows=0 if o.fuse else plan.chunk, **stores)
    if par is not None:
        run._retries = 0   # a chunk retried alone would leave the other ranks waiting in its exchanges
    if plan.kv != "device" and run.kv_store is None:   # L4/L5: K/V into a store, attended block by block
        out = kv_tiers.run_stored(handle, entry, sig, run, plan, device, consumer, donate, lambda: GraphRun(
            cap, an, found.phases, module, args, kwargs, rows, attend, ffn_slice=run.ffn_slice, regions=regions,
            pieces=o.row_pieces, fuse=fuse_on, fuse_rows=run.fuse_rows))
        _note_chains(handle, entry, run)
        return out
    if plan.tier == Tier.L3 or plan.q == "whole":   # the attention output whole, read by rows in phase Q
        run.build_grouped(plan.chunk, plan.head_groups, whole_q=plan.q == "whole")
    else:
        run.build_kv(plan.chunk)
    kv = run.kv[att.node] if adapted is not None else None   # phase Q lets go of its buffers: keep them
    out = run.run_q(plan.chunk, donate)
    _note_chains(handle, entry, run)
    if kv is not None:
        adapted.fill(*kv)
    return out


_BOOL_MASK = torch.empty(0, dtype=torch.bool)


def _note_chains(handle, entry, run) -> None:
    """What the report says of the call's element-wise chains: how many ran compiled, and each kept eager, why."""
    if run.fuse is None or not run.chains:
        return
    states = [(c, fuse.state(c, run.fuse)) for c in run.chains]
    done = sum(1 for _, s in states if s is not None and s.ok)
    if done:
        handle.note(entry, f"{done} chain(s) of element-wise ops each ran as one compiled kernel, exact (checked bit "
                    f"for bit against their eager ops on a first chunk)")
    for c, s in states:
        if s is not None and s.ok is False:
            handle.note(entry, f"a chain of {c.ops} ran eager: {s.why}")


def _workspace(consumer, call, elem: int, rows: int, q_static: int, keys: int, chunk: int) -> int:
    return workspace_bytes(consumer, call, elem, min(chunk, rows) + q_static, keys)


def _given_mask_bytes(mask, elem: int, rows: int, chunk: int) -> int:
    """Per chunk of a mask input over rows x rows: the kernel's additive copy of its rows."""
    keys = mask.shape[-1]
    lead = 1
    for size in mask.shape[:-2]:
        lead *= size if isinstance(size, int) else 1
    return lead * min(chunk, rows) * (keys if isinstance(keys, int) else rows) * elem


def _row_mask_bytes(row_mask: RowMask, elem: int, row_bytes: int, causal_ws: int, rows: int, chunk: int) -> int:
    return row_mask.chunk_bytes(chunk, elem, row_bytes) + causal_ws * min(chunk, rows)


def _attend_spans(consumer, row_mask: RowMask, q, k, v, a: int, scale, cap: dict, mean_of: dict):
    """Query rows [a, a + c) of a padded batch whose mask is padding and causality alone (``RowMask.spans``): for each
    batch element with keys [s, e) not padding, rows from s to e attend causally from key s, rows past e attend all of
    [s, e), each through the consumer's own unmasked calls; rows before s (no key to see) get the library's mask rows,
    as stock attends them."""
    b = a + q.shape[-2]
    out = q.new_empty(q.shape)
    for i, (s, e) in enumerate(row_mask.spans):
        qi, ki, vi = q[i:i + 1], k[i:i + 1], v[i:i + 1]
        blind = min(b, s) if e > s else b     # rows [a, blind) see no key
        if blind > a and row_mask.blind_rows_see_all:   # eager: every key of the call evenly
            out[i:i + 1, :, :blind - a] = _mean_v(v, out, mean_of)[i:i + 1]
        elif blind > a:
            lo, hi = row_mask.span(a, blind)
            out[i:i + 1, :, :blind - a] = consumer.attend(
                qi[:, :, :blind - a], ki[:, :, lo:hi], vi[:, :, lo:hi], q_offset=0, causal=False,
                mask=row_mask.part(a, blind, lo, hi)[i:i + 1], scale=scale, **cap)
        r0, r1 = max(a, blind), min(b, e)
        if r1 > r0:
            out[i:i + 1, :, r0 - a:r1 - a] = consumer.attend(
                qi[:, :, r0 - a:r1 - a], ki[:, :, s:e], vi[:, :, s:e], q_offset=r0 - s, causal=True, mask=None,
                scale=scale, **cap)
        r0 = max(a, blind, r1)
        if b > r0:   # rows past the last key that is not padding: all of [s, e)
            out[i:i + 1, :, r0 - a:] = consumer.attend(
                qi[:, :, r0 - a:], ki[:, :, s:e], vi[:, :, s:e], q_offset=0, causal=False, mask=None, scale=scale,
                **cap)
    return out


def _blind_rows_see_all(out: torch.Tensor, part: torch.Tensor, v: torch.Tensor, mean_of: dict) -> torch.Tensor:
    """Rows of ``part`` (the chunk's eager mask rows, [B, 1, c, keys]) that see no key: the mean of V over every key
    of the call, as eager attention gives them (the same minimum added to every score: an even softmax)."""
    seen = part if part.dtype == torch.bool else part > torch.finfo(part.dtype).min / 2
    blind = ~seen.any(-1, keepdim=True)                       # [B, 1, c, 1]
    return torch.where(blind, _mean_v(v, out, mean_of), out, out=out)   # in place: no copy of the chunk's output


def _mean_v(v: torch.Tensor, out: torch.Tensor, mean_of: dict) -> torch.Tensor:
    """V's mean over every key of the call, per query head ([B, H, 1, D]), once per V buffer (L3 attends a buffer
    per head group: held weakly, a later group's buffer is never taken for an earlier one's)."""
    held = mean_of.get("v")
    if held is None or held[0]() is not v:
        # summed in fp32 a chunk's rows of keys at a time: a whole fp32 copy of V (1 GiB for Gemma 2 at 131k
        # tokens) is a transient no plan charges
        step, n = max(1, out.shape[-2]), v.shape[-2]
        total = sum(v[..., s:s + step, :].sum(-2, keepdim=True, dtype=torch.float32) for s in range(0, n, step))
        mean = total.div_(n).to(out.dtype).repeat_interleave(out.shape[1] // v.shape[1], 1)
        held = mean_of["v"] = (weakref.ref(v), mean)
    return held[1]


def _stock_masked(entry, args: tuple, kwargs: dict) -> Any:
    """The stock call with its row masks built whole, as the library would have built them."""
    args, kwargs = row_masks_whole(args, kwargs)
    return entry.stock(*args, **kwargs)


def _row_mask_problem(an, row_mask: RowMask, rows: int) -> str | None:
    """Why a described mask cannot stand for the mask this graph's attention was captured without, or None: the graph
    must have one global attention, with no mask input, over the call's rows alone."""
    if len(an.attentions) != 1:
        return f"a row mask for a graph with {len(an.attentions)} global attentions"
    att = an.attentions[0]
    # captured with no mask, the attention is causal (SDPA's is_causal: the row mask replaces that rule) or attends
    # every key (eager's, hand-written: the row mask is its whole rule); either way the row mask is what it lacks
    if att.mask is not None or (att.kv_rows.pre, att.kv_rows.post) != (0, 0) or att.q_rows is None or (
            att.q_rows.pre, att.q_rows.post) != (0, 0):
        return "a row mask for an attention that takes a mask of its own or is not over the call's rows alone"
    if (row_mask.rows, row_mask.keys) != (rows, rows):
        return f"a row mask of {row_mask.rows} x {row_mask.keys} rows for a call of {rows}"
    return None
