"""What a captured block computes, read off its graph: the planner's time model prices a plan by its matmul FLOPs
(per dynamic row, per call for static rows and values without rows), its attention FLOPs, the bytes its allocating ops
write, its op count per phase (launches, rerun per chunk) and the weights each chunk re-reads. Per-row quantities
divide out the Rows dimension as ``memory.graph_memory`` does, so one capture prices every row count."""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from .analyze import Rows, bind, numel_besides, op_name, SDPA_OPS
from .memory import graph_memory
from .opaque_layers import OPS as OPAQUE_OPS, work as opaque_work
from .pruned_projections import find_prunings
from .row_pieces import RowRun, find_runs

_CONTRACT_LAST = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm"}   # K = the left operand's last size
_CONV = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution"}     # K = the weight's in/groups x kernel


@dataclass(frozen=True)
class BlockWork:
    """What one call of a captured block computes, per dynamic row and per call (the time model's inputs)."""

    rows: int                    # dynamic rows of the call
    gemm_flops_row: float        # matmul and convolution FLOPs per dynamic row (2*M*N*K); an opaque layer op (its
    # module is not in the graph) as its kind declares (by default a linear of its input and output widths)
    gemm_flops_static: float     # the same of static rows joined to the dynamic ones (Rows.pre/.post), per call
    # (every chunk recomputes them), with a non-global attention's static query rows
    gemm_flops_const: float      # the same of values without rows (phase const, once per call), attentions included
    attention_flops: float       # every global attention over the whole call: 2*Nq*Nk*(q + output width per row)
    # (4*Nq*Nk*heads*head_dim), halved when causal; Nq, Nk: rows plus the q, kv static rows
    attention_flops_row: float   # other attentions (cross-attention to a fixed set of keys): per dynamic query row
    bytes_row: float             # bytes per dynamic row written by ops that allocate (not views), every phase
    ops_kv: int                  # call_function ops phase KV runs per chunk (all of phases.kv), views included; an
    # opaque layer op as the kernel launches its kind declares
    ops_q: int                   # call_function ops phase Q runs per chunk
    ops_mlp: int                 # ops of the sliceable MLP regions, exit linear included (rerun per slice); 0 if none
    weight_bytes: int            # bytes of the parameters the graph reads (each chunk re-reads them); an opaque
    # layer's own weights are not among them
    kv_flops_row: float = 0.0    # matmul FLOPs per dynamic row of phase KV's ops (rerun per head group under L3)
    kv_bytes_row: float = 0.0    # bytes per dynamic row phase KV's allocating ops write
    rerun_flops_row: float = 0.0  # matmul FLOPs per row of ops both phases run (a fused projection feeding K/V and
    # Q: computed twice per row when streamed)
    rerun_bytes_row: float = 0.0  # bytes per row the ops both phases run write
    ops_runs: int = 0            # ops inside row-local runs (``row_pieces.find_runs``) per chunk over the phases:
    # run again by each row piece of a chunk
    ops_piece: int = 0           # ops each row piece adds beside them (its inputs' rows narrowed, its outputs copied
    # into the chunk's buffers)
    runs_bytes_row: float = 0.0  # bytes per row of the runs' outputs, written again by those copies
    attention_rerun_flops: float = 0.0  # global attentions run again streamed: a later attention's K/V read an
    # earlier one's output, so that attention's phase KV runs it (over every chunk) before phase Q runs it again


def _size(s) -> int | None:
    """A size as an int, None where it holds the row count."""
    e = s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s)
    return int(e) if e.is_Integer else None


def _contracted(n: fx.Node, name: str) -> int | None:
    """The contracted size K of a matmul-like op (FLOPs = 2 * output elements * K); None if not one (or K has rows)."""
    if name in _CONTRACT_LAST:
        a = n.args[1] if name in ("addmm", "baddbmm") else n.args[0]
        return _size(a.meta["val"].shape[-1])
    if name in _CONV:
        return numel_besides(n.args[1].meta["val"], 0) or None
    return None


def _attention_width(n: fx.Node) -> tuple[fx.Node, int]:
    """An attention's query and 2 * (query + output elements per query row): its FLOPs per query row and key."""
    q = bind(n)["query"]
    qv, ov = q.meta["val"], n.meta["val"]
    return q, 2 * (numel_besides(qv, qv.dim() - 2) + numel_besides(ov, ov.dim() - 2))


def block_work(found, rows: int) -> BlockWork:
    """The work of one call of ``found`` (a ``streamplan.graph.Streamable``) at ``rows`` dynamic rows."""
    an, ph, graph = found.analysis, found.phases, found.captured.graph
    row = static = const = att_row = 0.0
    per_node: dict[fx.Node, float] = {}
    global_ = {a.node for a in an.attentions} | {r.node for r in an.reduced}
    for n in graph.nodes:
        if n.op != "call_function" or n in an.ignored or n in global_:
            continue
        name = op_name(n.target)
        val = n.meta.get("val")
        out = val[0] if isinstance(val, (tuple, list)) else val
        r = an.rows.get(n)
        r = r[0] if isinstance(r, list) else r
        if name in SDPA_OPS:   # not global: the keys are fixed, the work per query row is known
            q, width = _attention_width(n)
            nk = _size(bind(n)["key"].meta["val"].shape[-2]) or 0
            if isinstance(r, Rows):
                att_row += width * nk
                static += width * nk * (r.pre + r.post)
            else:
                const += width * nk * (_size(q.meta["val"].shape[-2]) or 0)
            continue
        opaque = n.target in OPAQUE_OPS   # the wrapped module is not in the graph: its kind's FLOPs per row
        k = 1 if opaque else _contracted(n, name)
        if not k or not isinstance(out, torch.Tensor):
            continue
        if isinstance(r, Rows):
            per = opaque_work(n)[0] if opaque else 2 * numel_besides(out, r.dim) * k
            row, static = row + per, static + per * (r.pre + r.post)
            per_node[n] = per
        else:
            const += 2 * numel_besides(out, None) * k
    attention = rerun_attention = 0.0
    for a in an.attentions:
        _, width = _attention_width(a.node)
        nq = rows + a.q_rows.pre + a.q_rows.post if a.q_rows is not None else \
            found.captured.size_at(a.q.meta["val"].shape[-2], rows)
        nk = rows + a.kv_rows.pre + a.kv_rows.post
        flops = width * nq * nk / (2 if a.causal else 1)
        attention += flops
        rerun_attention += flops * sum(a.node in set(p) for p in ph.kv)
    for r in an.reduced:   # fixed queries against every row's keys, over the chunks
        _, width = _attention_width(r.node)
        attention += width * found.captured.size_at(r.q.meta["val"].shape[-2], rows) * rows
    mem = graph_memory(an, ph, rows, set())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weights = sum(numel_besides(n.meta["val"], None) * n.meta["val"].element_size()
                  for n, (kind, _) in zip(placeholders, found.captured.inputs) if kind == "param" and n.users)
    calls = lambda nodes: sum(opaque_work(n)[1] if n.target in OPAQUE_OPS else 1  # noqa: E731
                              for n in nodes if n.op == "call_function")
    written = lambda nodes: float(sum(mem.per_row.get(n, 0) for n in nodes if mem.allocates.get(n)))  # noqa: E731
    kv = {n for p in ph.kv for n in p}
    both = kv & set(ph.q)
    for att, nodes in zip(an.attentions, ph.kv):   # phase KV runs a pruned projection for its columns alone
        for p in find_prunings(nodes, {att.k, att.v}, an):
            if p.linear in per_node:
                per_node[p.linear] *= (p.hi - p.lo) / int(p.linear.meta["val"].shape[-1])
    runs = phase_runs(found)
    return BlockWork(rows, row, static, const, attention, att_row,
                     float(sum(b for n, b in mem.per_row.items() if mem.allocates[n])),
                     sum(calls(p) for p in ph.kv), calls(ph.q),
                     sum(calls(r.nodes) + 1 for r in found.mlp_regions), weights,
                     sum(per_node.get(n, 0.0) for n in kv), written(kv),
                     sum(per_node.get(n, 0.0) for n in both), written(both),
                     sum(calls(r.nodes) for r in runs),
                     sum(len([m for m in r.inputs if isinstance(an.rows.get(m), Rows)]) + len(r.outputs) for r in runs),
                     float(sum(mem.per_row.get(o, 0) for r in runs for o in r.outputs)),
                     attention_rerun_flops=rerun_attention)


def phase_runs(found) -> list[RowRun]:
    """The row-local runs each phase of a chunk has (as the executor and the memory model find them, the MLP whole):
    what row pieces re-launch per piece, and whether the block has any for the planner to cut in pieces."""
    an, ph = found.analysis, found.phases
    runs = [r for p, a in zip(ph.kv, an.attentions) for r in find_runs(p, an, {a.k, a.v})]
    return runs + find_runs(ph.q, an, {o for o in an.outputs if isinstance(o, fx.Node)})
