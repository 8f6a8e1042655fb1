"""Row pieces inside a chunk: a maximal run of row-local nodes that are neither GEMMs nor attentions (norms in fp32,
rotary, modulation) runs a piece of the chunk's rows at a time, the values that leave it written into chunk-sized
buffers, so its temporaries cost a fraction of the chunk instead of the chunk's worst moment. The memory model
(``memory.GraphMemory``) prices a run the same way, from the same ``find_runs``."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .analyze import MATMUL_OPS, SDPA_OPS, VIEW_OPS, Analysis, Rows, op_name, written_args, writes_in_place
from .opaque_layers import OPS as OPAQUE_OPS



@dataclass(eq=False)
class RowRun:
    prelude: list[fx.Node]     # views of values from before the run: taken on the whole chunk, first
    nodes: list[fx.Node]       # run a piece of rows at a time, in graph order
    inputs: list[fx.Node]      # values from outside the run its nodes read
    outputs: list[fx.Node]     # its values read after it (or kept), views excepted: each a chunk-sized buffer
    post: list[fx.Node]        # views of the outputs read after it: taken on the whole buffers, after it
    dead: dict[int, list[fx.Node]]   # after which node a piece's value is no longer needed (outputs excepted)
    marker: fx.Node            # the node at whose place the schedule runs the whole run
    reuse: dict[fx.Node, fx.Node]    # output -> an input (a GEMM's rows, dead after the run) whose storage it takes


def is_view(n: fx.Node) -> bool:
    """A value in its input's storage: a view, or a conversion to the dtype it has (which returns its input)."""
    if n.target is operator.getitem or op_name(n.target) in VIEW_OPS:
        return True
    if op_name(n.target) in ("to", "type_as") and n.all_input_nodes:
        val, src = n.meta.get("val"), n.all_input_nodes[0].meta.get("val")
        return isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.dtype == src.dtype \
            and val.device == src.device and not n.kwargs.get("copy", False)
    return False


def dynamic_rows(r) -> bool:
    """Rows without static ones (a tuple's elements each so), all of the chunk's (not one side of a cut at a fixed
    count: a piece of the chunk's rows is not a piece of the side's)."""
    parts = r if isinstance(r, list) else [r]
    return bool(parts) and all(isinstance(p, Rows) and not getattr(p, "cut_side", False) and not (p.pre or p.post)
                               and p.unit == 1 for p in parts)   # (a grid's lines: a piece of rows is not of lines)


def _member(n: fx.Node, an: Analysis, attention: set) -> bool:
    if n.op != "call_function" or n in attention:
        return False
    if n.target is operator.getitem:
        return dynamic_rows(an.rows.get(n))
    if routed(n):   # experts: their routed copies scale with the rows they are handed, a piece's in a piece
        return dynamic_rows(an.rows.get(n))
    if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "aten":
        return False   # a custom kernel may assume contiguous rows: left whole
    name = op_name(n.target)
    if name in MATMUL_OPS or name in SDPA_OPS or name.endswith("_") or written_args(n):
        return False
    return dynamic_rows(an.rows.get(n))


def routed(n: fx.Node) -> bool:
    """An opaque module (``opaque_layers``) with a workspace per row it is handed (a mixture of experts' routed
    copies): row-local, called through its own forward on any rows, so a run may hand it a piece of the chunk's."""
    return n.target is OPAQUE_OPS[0] and int(n.args[4]) > 0   # (one output: a pair's second is left whole)


def find_runs(nodes: list[fx.Node], an: Analysis, keep: set, extra: dict | None = None) -> list[RowRun]:
    """The runs among ``nodes`` (a phase as it is scheduled) worth cutting into pieces: at least two values allocated
    inside. None where the graph has static rows (their rows are computed once per phase) or writes in place (a
    piece's buffer would not be the storage the write reaches). ``keep``: values the phase hands on; ``extra``: inputs
    a node reads off the graph's edges (a feature-sliced MLP's exit)."""
    if an.input_writes or an.static_rows:
        return []
    if any(writes_in_place(n) for n in nodes):
        return []
    attention = {a.node for a in an.attentions} | {r.node for r in an.reduced}
    segments, seg = [], []
    for n in nodes:
        if _member(n, an, attention):
            seg.append(n)
        else:
            segments.append(seg)
            seg = []
    segments.append(seg)
    pos = {n: i for i, n in enumerate(nodes)}
    runs = []
    for seg in segments:
        run = _run(seg, pos, nodes, an, keep, extra or {})
        if run is not None:
            runs.append(run)
    return runs


def _run(seg: list[fx.Node], pos: dict, nodes: list[fx.Node], an: Analysis, keep: set,
         extra: dict) -> RowRun | None:
    inside = set(seg)
    prelude: list[fx.Node] = []
    for n in seg:   # views of what came before the run cost nothing whole: taken first, read in pieces
        if is_view(n) and all(m not in inside or m in prelude for m in n.all_input_nodes):
            prelude.append(n)
    members = [n for n in seg if n not in prelude]
    if sum(not is_view(n) for n in members) < 2:
        return None
    mset = set(members)
    last = pos[members[-1]]
    want = set(keep)
    for n in nodes[last + 1:]:
        want.update(n.all_input_nodes)
        want.update(extra.get(n, ()))
    outputs, post = [], []
    for n in reversed(members):   # a view read after the run is taken again on its base's buffer: one buffer each
        if n not in want:
            continue
        if is_view(n) and all(m in mset or m not in inside for m in n.all_input_nodes):
            post.insert(0, n)
            want.update(n.all_input_nodes)
        else:
            outputs.insert(0, n)
    if not outputs or any(not isinstance(n.meta.get("val"), torch.Tensor) for n in outputs):
        return None
    inputs = list(dict.fromkeys(m for n in members for m in n.all_input_nodes if m not in mset))
    marker = next(n for n in reversed(members) if n not in post)
    return RowRun(prelude, members, inputs, outputs, post, deaths(members, outputs), marker,
                  _reuse(inputs, outputs, nodes[:pos[seg[0]]], nodes[last + 1:], keep, extra, an))


def deaths(members: list[fx.Node], outputs: list[fx.Node]) -> dict[int, list[fx.Node]]:
    """After which of ``members`` (run in order, alone) each value made among them is read for the last time;
    ``outputs`` are kept."""
    mset = set(members)
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(members):
        for m in n.all_input_nodes:
            if m in mset:
                last_use[m] = i
    dead: dict[int, list[fx.Node]] = {}
    for m, i in last_use.items():
        if m not in outputs:
            dead.setdefault(i, []).append(m)
    return dead


def storage_node(n: fx.Node) -> fx.Node:
    while is_view(n) and n.all_input_nodes:
        n = n.args[0] if isinstance(n.args[0], fx.Node) else n.all_input_nodes[0]
    return n


def _row_bytes(n: fx.Node, an: Analysis) -> int | None:
    """Bytes per row of a value whose rows are its outermost dimension (only size-1 dimensions before them)."""
    val, r = n.meta.get("val"), an.rows.get(n)
    if not isinstance(val, torch.Tensor) or not isinstance(r, Rows):
        return None
    total = val.element_size()
    for i, size in enumerate(val.shape):
        if i == r.dim:
            continue
        if isinstance(size, torch.SymInt) or (i < r.dim and size != 1):
            return None
        total *= int(size)
    return total


def _reuse(inputs: list[fx.Node], outputs: list[fx.Node], before: list[fx.Node], after: list[fx.Node], keep: set,
           extra: dict, an: Analysis) -> dict[fx.Node, fx.Node]:
    """Outputs written into the storage of an input the phase made with a GEMM and nobody reads after the run, row
    for row (each piece's rows only once that piece has read them): the output costs no buffer of its own."""
    read_after = {storage_node(m) for n in after for m in [*n.all_input_nodes, *extra.get(n, ())]}
    read_after |= {storage_node(k) for k in keep}
    made = set(before)
    free = {}
    for m in inputs:
        b = storage_node(m)
        if b in made and b not in read_after and b.op == "call_function" and op_name(b.target) in MATMUL_OPS \
                and b not in free.values() and _row_bytes(b, an):
            free[m] = b
    reuse = {}
    for o in outputs:
        size = _row_bytes(o, an)
        m = next((m for m, b in free.items() if size and _row_bytes(b, an) == size), None)
        if m is not None:
            reuse[o] = m
            del free[m]
    return reuse


def schedule(nodes: list[fx.Node], runs: list[RowRun]) -> list[fx.Node]:
    """``nodes`` with each run's members replaced by its prelude, its marker and the views taken after it."""
    if not runs:
        return nodes
    skip = {n for r in runs for n in (*r.nodes, *r.prelude) if n is not r.marker}
    at = {r.marker: r for r in runs}
    out = []
    for n in nodes:
        if n in at:
            out += [*at[n].prelude, n, *at[n].post]
        elif n not in skip:
            out.append(n)
    return out


def run_pieces(run: RowRun, env: dict, an: Analysis, symbol, call, pieces: int) -> None:
    """The run over one chunk in ``pieces`` pieces of its rows; its outputs written into chunk-sized buffers in
    ``env``. ``call(node, env)`` runs one node; sizes that count the rows count the piece's."""
    rows = next(env[m].shape[an.rows[m].dim] for m in run.inputs
                if isinstance(an.rows.get(m), Rows) and isinstance(env[m], torch.Tensor))
    step = -(-rows // pieces)
    outs: dict[fx.Node, torch.Tensor] = {}
    for s in range(0, rows, step):
        e = min(rows, s + step)
        local = {}
        for m in run.inputs:
            v, r = env[m], an.rows.get(m)
            if isinstance(r, Rows) and isinstance(v, torch.Tensor):
                local[m] = v.narrow(r.dim, s, e - s)
            elif isinstance(m.meta.get("val"), torch.SymInt) and symbol in m.meta["val"].node.expr.free_symbols:
                local[m] = int(m.meta["val"].node.expr.subs(symbol, e - s))
            else:
                local[m] = v
        for i, n in enumerate(run.nodes):
            local[n] = call(n, local)
            for m in run.dead.get(i, ()):
                local.pop(m, None)
        for o in run.outputs:
            v, d = local[o], an.rows[o].dim
            if o not in outs:
                outs[o] = _buffer(v, d, rows, env.get(run.reuse.get(o)))
            outs[o].narrow(d, s, e - s).copy_(v)
        del local
    env.update(outs)


def _buffer(like: torch.Tensor, dim: int, rows: int, storage: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk-sized buffer laid out as a piece is (a permuted view's order kept), ``rows`` along ``dim``; in
    ``storage`` (a dead input of as many bytes, contiguous, rows outermost) where both are laid out row by row."""
    shape = list(like.shape)
    shape[dim] = rows
    if storage is not None and like.is_contiguous() and storage.is_contiguous() \
            and storage.numel() * storage.element_size() == like.element_size() * _prod(shape):
        return storage.reshape(-1).view(like.dtype).view(shape)
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    return like.new_empty([shape[d] for d in order]).permute([order.index(d) for d in range(like.dim())])


def _prod(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
