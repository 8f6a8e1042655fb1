"""Running a captured block in row chunks: values that do not depend on the rows once, then for each global
attention its K and V chunk by chunk into whole buffers (phase KV), then the whole graph chunk by chunk with each
global attention's Q chunk attended against those buffers, the outputs written chunk by chunk into their own
buffers (phase Q). Freed as soon as their last user has run, as the stock graph would."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .call_state import rehearsing
from .chunk_loop import MAX_SPLITS, attempt, chunk_bounds
from .chunk_replay import ChunkProgram, ChunkReplay
from .kv_stores import write_rows
from .row_contraction_run import build_contractions, grid_chunk
from .whole_rows import whole_buffer, write_chunk_rows
from ..graph.analyze import Analysis, GlobalAttention, Rows
from ..graph.export import Captured
from ..graph.fused_chains import FusedChain, run_chain
from ..graph.node_calls import call_node, compile_run
from ..graph.fixed_row_slices import run_cut
from ..graph.direct_writes import Into, Made, call_into, found
from ..graph.joins_in_place import run_join
from ..graph.sliced_mlp import MLPRegion, row_dim, run_region
from ..graph.pair_masks import PairRows
from ..graph.row_pieces import run_pieces
from ..graph.pruned_projections import run_pruned
from ..graph.schedule import ATTENTION, CHAIN, OP, PIECES, PRUNED, REDUCE, REGION, Schedule, phase_schedule
from ..graph.in_place import run_over
from ..graph.phases import Phases, ancestors, last_uses, q_roots, rowed_outputs
from ..attention import lse_attention
from ..plan.planner import REPLAY_MIN_CHUNKS
from ..attention.lse_merge import LseAccumulator

_LAYOUT = {"cat", "concat", "slice", "narrow", "split", "split_with_sizes", "chunk", "tensor_split"}


def _attend_kwargs(att: GlobalAttention, env: dict) -> dict:
    """The attend callable's keywords beyond Q, K and V for this chunk, each only where the attention has it: its
    mask (a key mask whole, a mask over rows x rows as the chunk's query rows, which ``GraphRun._inputs`` took) and
    its soft-capping (hand-written attention, ``eager_attention``)."""
    extra = {"softcap": att.softcap} if att.softcap else {}
    if att.sinks is not None:
        extra["sinks"] = env[att.sinks]
    if att.mask is None:
        return extra
    mask = env[att.mask]
    if mask.dim() >= 2 and mask.shape[-2] > 1 and mask.stride(-2) == 0:   # the same for every query row: as a key
        mask = mask.narrow(-2, 0, 1)                                         # mask, with no [chunk, keys] copy
    return {"mask": mask, **extra}


@dataclass(eq=False)
class PlainRun:
    """Consecutive plain ops of a chunk's steps as one generated function of the environment (``compile_run``)."""

    run: Callable[[dict], None]


def _compact(value: Any) -> Any:
    """A value kept past its chunk (a static row's, ``_static_rows_once``) holding its own bytes: a view of the
    chunk's rows would hold the whole chunk's storage, which the memory model does not count."""
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


class GraphRun:
    """One call of a captured block: its inputs bound, its constants computed, ready to run in chunks."""

    def __init__(self, cap: Captured, an: Analysis, ph: Phases, module: torch.nn.Module, args: tuple, kwargs: dict,
                 rows: int, attend: Callable[..., torch.Tensor], ffn_slice: int = 0,
                 regions: list[MLPRegion] | None = None, kv_store: Callable[[GlobalAttention], Any] | None = None,
                 attend_store: Callable[..., torch.Tensor] | None = None, pieces: int = 1,
                 fuse: torch.device | None = None, fuse_rows: int = 0, host: dict | None = None,
                 keep: tuple = (), attend_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                 replay: bool = False):
        self.cap, self.an, self.ph, self.rows, self.attend = cap, an, ph, rows, attend
        # the plan's chunk replay (``chunk_replay``): each phase's chunks of one size replayed as recordings
        self.replay = replay
        self.replay_problems: list[str] = []   # recordings that failed (the report)
        # a reduced attention's partial output over one chunk's keys, with its log-sum-exp (``reduced_attentions``)
        self.attend_lse = attend_lse or lse_attention(None)
        self.pieces = pieces   # row-local runs in this many pieces of a chunk's rows (1: every node on the chunk)
        self.fuse = fuse if pieces == 1 else None   # element-wise chains compiled for this device (``fuse``)
        self.fuse_rows = fuse_rows   # set: only chains whose outputs at this many rows are worth a compiled call
        self.chains: dict[FusedChain, None] = {}   # the chains this call ran (its report)
        self.prunings: dict = {}   # the projections this call ran for the columns their phase reads (its report)
        # L4/L5: each global attention's K/V go into a store (``execute.kv_stores``) made by ``kv_store`` and are
        # attended block by block through ``attend_store(q, store, q_offset=, causal=, scale=)``
        self.kv_store, self.attend_store = kv_store, attend_store
        self.stores: dict[fx.Node, Any] = {}
        self.ffn_slice = ffn_slice
        # a chunk that runs out of memory is retried in halves, unless the block writes into its inputs or merges a
        # reduced attention (a half-done chunk would leave them changed) or its capture holds only from more rows
        # than a half might have
        self._retries = 0 if an.input_writes or an.reduced or cap.min_rows > 2 else MAX_SPLITS
        self.regions = list(regions or []) if ffn_slice else []
        self._schedules: dict[tuple, Schedule] = {}
        self._cuts: dict[int, tuple[list, list]] = {}   # a schedule's runs and attentions, cut for a replay
        self._input_parts: tuple | None = None   # ``_split_inputs``' answer, and the input counts it holds for
        self._freed: dict = {}   # a step -> the values it lets go of (``_frees_of``)
        self._plain: dict[int, tuple[list, list]] = {}   # a list of steps -> it with its plain runs compiled
        self._into: dict[fx.Node, Into] = {}   # a K/V/output value whose producer writes into its buffer: direct_writes
        self._made: dict[fx.Node, Made | None] = {}   # what a watched producer made on a first chunk
        flat = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: x is None)
        self.base: dict[fx.Node, Any] = {}
        placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
        for node, (kind, ref) in zip(placeholders, cap.inputs):
            if kind == "user":
                self.base[node] = flat[ref]
            elif kind == "param":
                self.base[node] = module.get_parameter(ref)
            elif kind == "buffer":
                self.base[node] = module.get_buffer(ref)
            else:
                self.base[node] = cap.program.constants[ref]
            if is_traceable_wrapper_subclass(self.base[node]):
                # the graph reads a tensor subclass's parts by the names its flatten gives them, and a subclass may
                # only set those names when flattened (a quantized weight whose scales are its parts)
                self.base[node].__tensor_flatten__()
        # L6: inputs in host memory (``host_rows``), each chunk's rows copied to the compute device
        self.sources = {n: host[id(v)] for n, v in self.base.items() if host and id(v) in host}
        self.kv: dict[fx.Node, tuple[torch.Tensor, torch.Tensor]] = {}
        self.attn_out: dict[fx.Node, torch.Tensor] = {}
        self._base = 0   # the first row of what ``attn_out`` holds
        self._held_static = (0, 0)   # static rows ``attn_out`` holds before and after its rows (a first Q span's)
        self._chunk = (0, 0)   # the rows the running chunk's phase covers
        # attentions a later attention's phase KV runs (``phases.keepable_outputs``): the first phase KV that runs
        # one keeps its output whole, and phase Q reads its rows there instead of attending again
        self._keep_in: dict[int, list[GlobalAttention]] = {}
        for a in keep:
            j = next(j for j, p in enumerate(ph.kv) if a.node in p)
            self._keep_in.setdefault(j, []).append(a)
        self.consts: dict[fx.Node, Any] = {}
        self._static_rows_once(cap)
        env = dict(self.base)
        frees = last_uses(ph.const)
        for i, node in enumerate(ph.const):   # each value let go after its last use unless a later phase reads it
            env[node] = self._call(node, env)
            for m in frees.get(i, ()):
                if m in an.const and m not in ph.held_consts:
                    env.pop(m, None)
        self.consts = {n: env[n] for n in ph.const if n in ph.held_consts}
        self._builtwhole_buffer(env)
        self._pair_masks(env)

    def _builtwhole_buffer(self, env: dict) -> None:
        """Values built from the row count alone (a key mask, positions): once per call over every row, then read by
        the chunks as inputs are (``Analysis.built_whole``). Sizes that count rows count all of them."""
        if not self.an.built_whole:
            return
        need = ancestors(list(self.an.built_whole), set(env), {})
        for node in (n for n in self.cap.graph.nodes if n in need):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and self.cap.row_symbol in val.node.expr.free_symbols:
                env[node] = self.cap.size_at(val, self.rows)
            elif node not in self.an.ignored:
                env[node] = self._call(node, env)
        for node in self.an.built_whole:
            self.base[node] = env[node]

    def _pair_masks(self, env: dict) -> None:
        """Masks over rows x rows built inside the block: each chunk's query rows built alone when it reads them, from
        values read whole (``graph.pair_masks``)."""
        for node, pm in self.an.pair_masks.items():
            self.base[node] = None
            self.sources[node] = PairRows(pm, {n: env[n] for n in pm.leaves},
                                          functools.partial(self.cap.size_at, rows=self.rows))

    # -- static rows once ------------------------------------------------------------------------------------
    def _static_rows_once(self, cap: Captured) -> None:
        """Where static rows (text joined to image rows) exist, only the first chunk of a phase computes them; later
        chunks run the dynamic rows alone: values without dynamic rows come from the first chunk (they are the same
        in every chunk), joins and cuts along the rows pass the dynamic rows through, and sizes that count rows
        count the chunk's own."""
        an = self.an
        self.static_mode = an.static_rows
        self.cache: dict[fx.Node, Any] = {}
        if not self.static_mode:
            return
        nodes = [n for n in cap.graph.nodes if n.op == "call_function" and n not in an.ignored]
        self.static_only = {n for n in nodes if an.rows.get(n) is None and n not in an.const
                            and not isinstance(n.meta.get("val"), (torch.SymInt, int, float, bool))}
        outputs = {o for o in an.outputs if isinstance(o, fx.Node)}
        self.wanted = {n for n in self.static_only if n in outputs or any(u not in self.static_only for u in n.users)}
        self.layout = set()
        for n in nodes:
            name = getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")
            if name not in _LAYOUT or n in self.static_only or n in an.fixed_cuts or n in an.fixed_joins:
                continue   # (a cut at a fixed count and its join run on the chunk's rows as they are)
            src = n.args[0][0] if name in ("cat", "concat") else n.args[0]
            dim = n.args[1] if len(n.args) > 1 and name in ("cat", "concat") else (
                n.args[2] if name in ("split", "split_with_sizes", "chunk", "tensor_split") and len(n.args) > 2
                else n.args[1] if name in ("slice", "narrow") and len(n.args) > 1 else n.kwargs.get("dim", 0))
            ins = [t for t in (n.args[0] if name in ("cat", "concat") else [n.args[0]])
                   if isinstance(an.rows.get(t), Rows)]
            if not ins or not isinstance(src, fx.Node):
                continue
            r = an.rows[ins[0]]
            if isinstance(dim, int) and (dim + ins[0].meta["val"].dim() if dim < 0 else dim) == r.dim:
                self.layout.add(n)

    def _later_chunk(self, a: int) -> bool:
        """Whether the chunk from row ``a`` runs its dynamic rows alone (static rows, not a phase's first chunk). A
        phase's first chunk computes the values without dynamic rows again: the earlier phase's are let go, so they
        are not held through this one."""
        if not self.static_mode:
            return False
        if a == 0:
            self.cache.clear()
        return a > 0

    def _dynamic(self, node: fx.Node, env: dict, rows: int, over: fx.Node | None = None) -> Any:
        """A node's value on a chunk of dynamic rows alone (``rows`` of them); ``over``: an operand of dynamic rows
        alone it is written over (``phases.in_place``)."""
        if node in self.static_only:
            return self.cache.get(node)
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and self.cap.row_symbol in val.node.expr.free_symbols:
            return rows
        if node in self.layout:
            if node.args and isinstance(node.args[0], (list, tuple)):    # cat along the rows: its dynamic input
                return env[next(t for t in node.args[0] if isinstance(self.an.rows.get(t), Rows))]
            out = self.an.rows.get(node)
            if isinstance(out, list):                                     # split along the rows
                return [env[node.args[0]] if isinstance(r, Rows) else None for r in out]
            return env[node.args[0]]                                      # slice keeping the dynamic rows
        if over is not None:
            return run_over(node, over, env, self._call)
        return self._call(node, env)

    # -- one node ---------------------------------------------------------------------------------------------
    _call = staticmethod(call_node)

    def _split_inputs(self) -> tuple[dict, list]:
        """The environment every chunk starts from (constants, weights, inputs read whole), and the inputs each
        chunk takes its part of: worked out once per call, not per chunk (a block reads dozens of weights)."""
        key = (len(self.base), len(self.sources))
        if self._input_parts is not None and self._input_parts[0] == key:
            return self._input_parts[1]
        fixed, rowed = dict(self.consts), []
        for node, value in self.base.items():
            r = self.an.rows.get(node)
            if node not in self.sources and (node in self.an.whole_inputs or not isinstance(r, Rows)):
                fixed[node] = value
            else:
                rowed.append((node, value, r))
        self._input_parts = (key, (fixed, rowed))
        return fixed, rowed

    def _inputs(self, a: int, b: int, dynamic: bool = False) -> dict:
        fixed, rowed = self._split_inputs()
        env = dict(fixed)
        for node, value, r in rowed:
            part = functools.partial(self._part, node, value)
            if node in self.an.whole_inputs:   # a mask over the keys: every chunk attends all of them
                env[node] = part(0, 0, None)
            elif isinstance(r, Rows) and (r.pre or r.post) and dynamic:
                env[node] = part(r.dim, r.pre + a, b - a)
            elif isinstance(r, Rows) and (r.pre or r.post):   # an input with static rows joined: keep them whole
                segments = [part(r.dim, 0, r.pre)] if r.pre else []
                segments.append(part(r.dim, r.pre + a, b - a))
                if r.post:
                    segments.append(part(r.dim, r.pre + self.rows, r.post))
                env[node] = torch.cat(segments, r.dim)
            else:
                env[node] = part(r.dim, a, b - a) if isinstance(r, Rows) else part(0, 0, None)
        return env

    def _part(self, node: fx.Node, value: Any, dim: int, start: int, n: int | None) -> Any:
        """Rows [start, start + n) of an input along ``dim`` (``n`` None: all of it), on the compute device: a view,
        or for host rows (L6) a copy of them."""
        source = self.sources.get(node)
        if source is not None:   # host rows (L6) copied, or rows a model forward builds per chunk (``RowsFrom``)
            return source.part(dim, start, n)
        return value if n is None else value.narrow(dim, start, n)

    def _attention(self, att: GlobalAttention, env: dict, a: int) -> torch.Tensor:
        if att.node in self.attn_out:   # built ahead (L3's head groups, a whole Q, a Q span): its rows from ``_base``
            return self._rows_ahead(att, a)
        store = self.stores.get(att.node)
        if store is not None:
            return self.attend_store(env[att.q], store, q_offset=a, causal=att.causal, scale=att.scale)
        k, v = self.kv[att.node]
        q = env[att.q]
        return self.attend(q, k, v, q_offset=a, causal=att.causal, scale=att.scale, **_attend_kwargs(att, env))

    def _rows_ahead(self, att: GlobalAttention, a: int) -> torch.Tensor:
        """The running chunk's rows of an attention output built ahead; where it holds static rows around its own
        (a first Q span's), the phase's first chunk takes them with its rows, later chunks their dynamic rows alone
        (``_static_rows_once``)."""
        o, d, (pre, post) = self.attn_out[att.node], att.q_rows.dim, self._held_static
        rows = o.narrow(d, pre + a - self._base, self._chunk[1] - a)
        if not (pre or post) or (self.static_mode and a > 0):
            return rows
        if not post:   # the static rows before the chunk's: one view
            return o.narrow(d, 0, pre + self._chunk[1] - a)
        return torch.cat([*([o.narrow(d, 0, pre)] if pre else []), rows, o.narrow(d, o.shape[d] - post, post)], d)

    def _run(self, nodes: list[fx.Node], env: dict, a: int, keep: set[fx.Node], rows: int | None = None,
             into: dict[fx.Node, torch.Tensor] | None = None, watch: set[fx.Node] = frozenset()) -> dict:
        """Run ``nodes`` on one chunk, step by step as their schedule says; ``rows`` set: the chunk's dynamic rows
        alone (static rows done once); ``into``: producers that write into the given tensors (their ``out=``);
        ``watch``: producers whose value's layout ``_made`` records."""
        return self._steps(self._schedule(nodes, keep).steps, env, a, keep, rows, into, watch)

    def _steps(self, steps: list, env: dict, a: int, keep: set[fx.Node], rows: int | None = None,
               into: dict[fx.Node, torch.Tensor] | None = None, watch: set[fx.Node] = frozenset()) -> dict:
        """``_run``'s steps (a whole schedule, or a replay's run between attentions); runs of plain ops as one
        generated function each (``_plain_runs``) where the chunk has every row (static rows' later chunks run their
        dynamic rows step by step)."""
        built: dict[fx.Node, torch.Tensor] = {}   # this chunk's joins built in place so far
        for item in self._plain_runs(steps, keep) if rows is None and len(steps) > 1 else steps:
            if type(item) is PlainRun:
                item.run(env)
            else:
                self._step(item, env, a, keep, rows, into, watch, built)
        return env

    def _plain_runs(self, steps: list, keep: set[fx.Node]) -> list:
        """``steps`` with each run of two or more plain ops (the node's own op, none of the rewrites, not a producer
        that may write into a buffer or be watched, nor a static value a first chunk caches) compiled into one
        function (``node_calls.compile_run``): worked out once per list of steps (a schedule's, a replay's run)."""
        found = self._plain.get(id(steps))
        if found is not None:
            return found[1]
        cuts, special = self.an.fixed_cuts, set(self.ph.producers.values())
        if self.static_mode:
            special |= self.wanted
        out, run = [], []

        def flush() -> None:
            fn = compile_run([(s.node, self._frees_of(s, keep)) for s in run]) if len(run) > 1 else None
            out.extend([PlainRun(fn)] if fn is not None else run)
            run.clear()

        for step in steps:
            if step.kind == OP and step.join is None and step.over is None and step.node not in cuts \
                    and step.node not in special:
                run.append(step)
            else:
                flush()
                out.append(step)
        flush()
        self._plain[id(steps)] = (steps, out)   # (the list held, so its id is not reused)
        return out

    def _step(self, step, env: dict, a: int, keep: set[fx.Node], rows: int | None, into: dict | None, watch: set,
              built: dict) -> None:
        """One step of a chunk, as its kind says."""
        node, kind = step.node, step.kind
        if kind == PIECES:
            run_pieces(step.item, env, self.an, self.cap.row_symbol, self._call, self.pieces)
        elif kind == CHAIN:
            run_chain(step.item, env, self.an, self.cap.row_symbol, self._call, self.fuse)
        elif kind == REGION:
            env[node] = run_region(step.item, env, self.ffn_slice, row_dim(step.item, self.an))
        elif kind == ATTENTION:
            env[node] = self._attention(step.item, env, a)
        elif kind == REDUCE:
            env[node] = self._reduce(step.item, env)
        elif kind == PRUNED:
            self._pruned(step.item, env, rows, into, watch)
        elif node in self.an.fixed_cuts:   # rows cut at a fixed count: the chunk's part of each side
            env[node] = run_cut(self.an.fixed_cuts[node], env[node.args[0]], self.rows, a, rows is not None,
                                self.cap.row_symbol)
        elif rows is not None:
            env[node] = self._dynamic(node, env, rows, step.over)
        elif step.join is not None and (joined := run_join(step.join, node, env, built, into)) is not None:
            env[node] = joined
            del joined   # the name would hold the joined buffer to the chunk's end
        elif into and node in into:
            env[node] = call_into(node, env, into[node])
        elif step.over is not None:
            env[node] = run_over(node, step.over, env, self._call)
        else:
            env[node] = self._call(node, env)
            if self.static_mode and node in self.wanted:
                self.cache[node] = _compact(env[node])
        if watch and node in watch:
            self._made[node] = Made.of(env[node])
        self._drop(step, env, keep)

    def _frees_of(self, step, keep: set[fx.Node]) -> tuple:
        """The values ``step`` reads last that the chunk lets go of (not what it hands on, the constants or the
        inputs), worked out once per step: a step belongs to one schedule, and so to one ``keep``."""
        frees = self._freed.get(step)
        if frees is None:
            frees = self._freed[step] = tuple(m for m in step.frees
                                              if m not in keep and m not in self.consts and m not in self.base)
        return frees

    def _drop(self, step, env: dict, keep: set[fx.Node]) -> None:
        """Let go of the values ``step`` reads last."""
        for m in self._frees_of(step, keep):
            env.pop(m, None)

    def _program(self, nodes: list[fx.Node], keep: set[fx.Node], a: int, rows: int | None,
                 outputs) -> ChunkProgram:
        """One chunk's schedule cut at its attentions for a replay (``chunk_replay``): the runs between them recorded,
        each attention run eager for this chunk (its rows start at ``a``)."""
        schedule = self._schedule(nodes, keep)
        cut = self._cuts.get(id(schedule))
        if cut is None:
            runs, breaks, run = [], [], []
            for step in schedule.steps:
                if step.kind == ATTENTION:
                    runs.append(run)
                    breaks.append(step)
                    run = []
                else:
                    run.append(step)
            cut = self._cuts[id(schedule)] = (runs + [run], breaks)
        return ChunkProgram(
            cut[0], cut[1], run=lambda steps, env: self._steps(steps, env, a, keep, rows),
            brk=lambda step, env: self._steps([step], env, a, keep, rows), drop=lambda step, env: self._drop(
                step, env, keep), reads=lambda step: [n for n in (step.item.q, step.item.mask, step.item.sinks)
                                                      if n is not None],
            outputs=tuple(outputs))

    def _pruned(self, p, env: dict, rows: int | None, into: dict | None, watch: set) -> None:
        """A projection for the columns its phase reads; as the graph says where its linear writes into a buffer
        or is watched (``direct_writes``), and on static rows' later chunks where any of its nodes is a value without
        dynamic rows or a cut along the rows."""
        if p.linear in watch or (into and p.linear in into):
            for node in p.nodes:
                env[node] = call_into(node, env, into[node]) if into and node in into else self._call(node, env)
            return
        if rows is not None and self.static_mode and (self.static_only | self.layout) & set(p.nodes):
            for node in p.nodes:
                env[node] = self._dynamic(node, env, rows)
            return
        run_pruned(p, env, self._call)
        if self.static_mode:
            for leaf in p.leaves:
                if leaf in self.wanted:
                    self.cache[leaf] = _compact(env[leaf])

    def _schedule(self, nodes: list[fx.Node], keep: set[fx.Node]) -> Schedule:
        """A phase's schedule (``graph.schedule``), worked out once per call and phase, not per chunk."""
        key = (tuple(nodes), frozenset(keep))
        found = self._schedules.get(key)
        if found is None:
            found = self._schedules[key] = phase_schedule(
                nodes, keep, self.an, self.ph, regions=self.regions, pieces=self.pieces, fuse=self.fuse is not None,
                fuse_rows=self.fuse_rows, layout=frozenset(self.layout) if self.static_mode else frozenset())
            self.chains.update(dict.fromkeys(found.chains))
            self.prunings.update(dict.fromkeys(found.prunings))
        return found

    # -- values written straight into their buffers (``direct_writes``) -------------------------------------------
    def _producer(self, value: fx.Node, donated: bool = False) -> fx.Node | None:
        """``value``'s producer where it may write into the value's buffer (a donated input: only from the end)."""
        if self.static_mode or (donated and value not in self.ph.last):
            return None
        return self.ph.producers.get(value)

    def _watch(self, values, donated: bool = False) -> set[fx.Node]:
        """The producers whose value's layout a first chunk records, so ``_found`` can see it."""
        return {p for v in values if v not in self._into and (p := self._producer(v, donated)) is not None}

    def _found(self, value: fx.Node, env: dict, buf: torch.Tensor, r: Rows) -> None:
        p = self.ph.producers.get(value)
        if isinstance(env.get(value), torch.Tensor) and env[value].device != buf.device:   # host rows (L6): copied
            return
        if p is not None and value not in self._into and p in self._made and isinstance(env.get(value), torch.Tensor):
            got = found(p, self.an, self._made.pop(p), env[value], buf, r.dim, self.rows)
            if got is not None:
                self._into[value] = got

    def _dests(self, values, a: int, b: int) -> dict[fx.Node, torch.Tensor]:
        return {i.node: i.dest(a, b) for v in values if (i := self._into.get(v)) is not None}

    # -- the phases ---------------------------------------------------------------------------------------------
    def no_retries(self) -> None:
        """Never retry a chunk alone in halves (under sequence parallelism the other ranks would wait in its
        exchanges)."""
        self._retries = 0

    def _before_phases(self, chunk: int) -> int:
        """The chunk on whole lines where the rows are a grid, and the contractions over every row computed first
        (``row_contraction_run``): K/V and Q chunks read them as inputs."""
        chunk = grid_chunk(self.cap, chunk)
        build_contractions(self, chunk)
        return chunk

    def _replayer(self, chunk: int) -> ChunkReplay | None:
        """A phase's replay, where the plan asks for one and enough chunks of ``chunk`` rows follow the first two."""
        if not self.replay or self.rows // max(chunk, 1) < REPLAY_MIN_CHUNKS or self.attn_out or self.stores:
            return None
        staged = [n for n, _, _ in self._split_inputs()[1] if n not in self.an.whole_inputs]   # each chunk's own
        device = next(v.device for v in self.base.values() if isinstance(v, torch.Tensor))
        return ChunkReplay(device, staged, chunk, fake=rehearsing())

    def _close(self, replay: ChunkReplay | None) -> None:
        if replay is not None:
            if replay.problem:
                self.replay_problems.append(replay.problem)
            replay.close()

    def build_kv(self, chunk: int) -> None:
        chunk = self._before_phases(chunk)
        for j, (att, nodes) in enumerate(zip(self.an.attentions, self.ph.kv)):
            bufs: list[torch.Tensor] = []
            store = self.kv_store(att) if self.kv_store is not None else None
            keeps, kept = self._keep_in.get(j, []), {}

            replay = self._replayer(chunk) if store is None and not keeps else None

            def work(a: int, b: int, att=att, nodes=nodes, bufs=bufs, store=store, keeps=keeps, kept=kept,
                     replay=replay) -> None:
                dyn = self._later_chunk(a)
                self._chunk = (a, b)   # a later phase KV that runs a kept attention reads its rows (``_attention``)
                values = (att.k, att.v) if store is None else ()
                wanted = {att.k, att.v, *(k.node for k in keeps)}
                if replay is not None and replay.takes(a, b):
                    env = replay.run(self._inputs(a, b, dyn),
                                     self._program(nodes, wanted, a, b - a if dyn else None, (att.k, att.v)))
                else:
                    watch = self._watch(values) if not bufs else set()
                    env = self._run(nodes, self._inputs(a, b, dyn), a, wanted, b - a if dyn else None,
                                    self._dests(values, a, b), watch)
                for k in keeps:   # an earlier attention's output, kept for phase Q
                    o = env.pop(k.node)
                    if k.node not in kept:
                        kept[k.node] = whole_buffer(o, k.q_rows, self.rows)
                    write_chunk_rows(kept[k.node], o, k.q_rows, self.rows, a, b, a == 0)
                    del o
                kc, vc = env[att.k], env[att.v]
                if store is not None:
                    r = att.kv_rows
                    write_rows(store, kc, vc, r.pre, r.post, self.rows, a, b, a == 0)
                    return
                if not bufs:
                    bufs += [whole_buffer(kc, att.kv_rows, self.rows), whole_buffer(vc, att.kv_rows, self.rows)]
                    self._found(att.k, env, bufs[0], att.kv_rows)
                    self._found(att.v, env, bufs[1], att.kv_rows)
                write_chunk_rows(bufs[0], kc, att.kv_rows, self.rows, a, b, a == 0)
                write_chunk_rows(bufs[1], vc, att.kv_rows, self.rows, a, b, a == 0)

            for a, b in chunk_bounds(self.rows, chunk, self.cap.min_rows):
                attempt(work, a, b, self._retries)
            self._close(replay)
            self.attn_out.update(kept)
            if store is not None:
                store.finish()
                self.stores[att.node] = store
                continue
            self.kv[att.node] = (bufs[0], bufs[1])

    def build_grouped(self, chunk: int, groups: int, whole_q: bool = False) -> None:
        """L3: the attention's K and V built and attended for ``groups`` groups of heads in turn, each group's output
        written into one whole attention output; phase Q then reads its rows. K and V of one group exist at a time
        (the projections before them run once per group). ``whole_q`` (one group): Q built chunk by chunk into one
        whole buffer and attended in one call, for a consumer that needs every query row at once."""
        if whole_q and groups != 1:
            raise ValueError(f"a whole-Q attention is one call: {groups} head groups would make {groups}")
        chunk = self._before_phases(chunk)
        att, kv_nodes = self.an.attentions[0], self.ph.kv[0]
        q_nodes = self._q_nodes(att)
        out = None
        for g in sorted({0, groups - 1}) if rehearsing() else range(groups):   # a rehearsal: the groups repeat
            bufs: list[torch.Tensor] = []
            for a, b in chunk_bounds(self.rows, chunk, self.cap.min_rows):
                env = self._run(kv_nodes, self._inputs(a, b), a, {att.k, att.v})
                kc, vc = env[att.k], env[att.v]
                hk = kc.shape[1] // groups
                kc, vc = kc[:, g * hk:(g + 1) * hk], vc[:, g * hk:(g + 1) * hk]
                if not bufs:
                    bufs += [whole_buffer(kc, att.kv_rows, self.rows), whole_buffer(vc, att.kv_rows, self.rows)]
                write_chunk_rows(bufs[0], kc, att.kv_rows, self.rows, a, b, True)
                write_chunk_rows(bufs[1], vc, att.kv_rows, self.rows, a, b, True)
                del env, kc, vc
            if whole_q:
                out = self._attendwhole_buffer(att, q_nodes, chunk, bufs[0], bufs[1])
            else:
                for a, b in chunk_bounds(self.rows, chunk, self.cap.min_rows):
                    q = self._run(q_nodes, self._inputs(a, b), a, {att.q})[att.q]
                    h = q.shape[1] // groups
                    o = self.attend(q[:, g * h:(g + 1) * h], bufs[0], bufs[1], q_offset=a, causal=att.causal,
                                    scale=att.scale, **_attend_kwargs(att, self._inputs(a, b)))
                    if out is None:
                        shape = list(o.shape)
                        shape[1], shape[2] = q.shape[1], self.rows
                        out = o.new_empty(shape)
                    out[:, g * h:(g + 1) * h, a:b] = o
                    del q, o
            del bufs
        self.attn_out[att.node] = out

    def _attendwhole_buffer(self, att: GlobalAttention, q_nodes: list[fx.Node], chunk: int, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Q chunk by chunk into one whole buffer, then the attention over every row in one call."""
        q_all = self._q_rows(att, q_nodes, 0, self.rows, chunk)
        mask = _attend_kwargs(att, self._inputs(0, self.rows) if att.mask is not None else {})
        return self.attend(q_all, k, v, q_offset=0, causal=att.causal, scale=att.scale, **mask)

    def _q_rows(self, att: GlobalAttention, q_nodes: list[fx.Node], s0: int, s1: int, chunk: int) -> torch.Tensor:
        """The attention's Q over rows [s0, s1), built chunk by chunk into one buffer. With static rows the phase's
        first chunk computes them and the buffer from row 0 holds them around its rows (``_held_rows``); later chunks
        run their dynamic rows alone (``_static_rows_once``)."""
        held = self._held_rows(att, s0)
        q_all = None
        for a, b in chunk_bounds(s1 - s0, chunk, self.cap.min_rows):
            dyn = self._later_chunk(s0 + a)
            q = self._run(q_nodes, self._inputs(s0 + a, s0 + b, dyn), s0 + a, {att.q}, b - a if dyn else None)[att.q]
            if q_all is None:
                q_all = whole_buffer(q, held, s1 - s0)
            write_chunk_rows(q_all, q, held, s1 - s0, a, b, not dyn)
            del q
        return q_all

    def _held_rows(self, att: GlobalAttention, s0: int) -> Rows:
        """Where a buffer of the attention's Q (or output) from row ``s0`` holds its rows: the static rows around
        them from row 0, none after (a later chunk's dynamic rows alone)."""
        r = att.q_rows
        return r if s0 == 0 or not self.static_mode else dataclasses.replace(r, pre=0, post=0)

    def query_rows(self, att: GlobalAttention, a: int, b: int) -> torch.Tensor:
        """The attention's Q over rows [a, b) (with any static rows, as a first chunk has them), from the inputs
        alone: what an approximate store's error check attends, built before phase KV. Run as phase Q runs a chunk:
        on its rows and their halo where convolutions read neighbouring rows."""
        halo = getattr(self.an, "halo", (0, 0))
        lo, hi = max(0, a - halo[0]), min(self.rows, b + halo[1])
        q = self._run(self._q_nodes(att), self._inputs(lo, hi), lo, {att.q})[att.q]
        return q if (lo, hi) == (a, b) else q.narrow(att.q_rows.dim, att.q_rows.pre + a - lo, b - a)

    def _reduce(self, r, env: dict) -> torch.Tensor:
        """A reduced attention's fixed queries against this chunk's keys, merged into its output so far."""
        q = env[r.q]
        o, lse = self.attend_lse(q, env[r.k], env[r.v], scale=r.scale)
        self._merged.setdefault(r.node, LseAccumulator(q)).add(o, lse)
        return o

    def _run_tail(self, outs: list) -> None:
        """After phase Q's last chunk: the reduced attentions' outputs, and what reads them, once."""
        env = {**self.consts, **{n: v for n, v in self.base.items() if not isinstance(self.an.rows.get(n), Rows)}}
        for r in self.an.reduced:
            env[r.node] = self._merged.pop(r.node).result(r.node.meta["val"].dtype)
        frees = last_uses(self.ph.tail)
        wanted = {o for o in self.an.outputs if isinstance(o, fx.Node)}
        for i, node in enumerate(self.ph.tail):
            if node not in self.an.ignored:
                env[node] = self._call(node, env)
            for m in frees.get(i, ()):
                if m not in wanted and m not in self.consts:
                    env.pop(m, None)
        for i, o in enumerate(self.an.outputs):
            if isinstance(o, fx.Node) and o in env and o in self.ph.tail:
                outs[i] = env[o]

    def _q_nodes(self, att: GlobalAttention) -> list[fx.Node]:
        return [n for n in self.ph.q if n in ancestors([att.q], self._stop(), self.ph.writes, {})]

    def _stop(self) -> set[fx.Node]:
        placeholders = {n for n in self.cap.graph.nodes if n.op == "placeholder"}
        return set(self.an.const) | self.an.read_as_inputs | placeholders

    def run_q(self, chunk: int, donate: dict[int, torch.Tensor], span: int = 0) -> Any:
        """Phase Q; ``donate`` maps an output index to a tensor of the same shape that may be overwritten. ``span``
        (a store's K/V, one global attention): the queries of ``span`` rows at a time are built and attended in one
        pass over the store, then the span's chunks run over rows of that output (fewer passes, fewer copies back)."""
        chunk = self._before_phases(chunk)
        outs: list[Any] = [None] * len(self.an.outputs)
        keep = {o for o in self.an.outputs if isinstance(o, fx.Node)}
        self._merged: dict[fx.Node, LseAccumulator] = {}   # each reduced attention's output so far
        span = span if span > chunk and self.stores and len(self.an.attentions) == 1 and self.an.halo == (0, 0) \
            else 0

        nodes = self.ph.q
        if self.attn_out or span:   # an attention reads its rows of an output built ahead: its Q is not computed again
            ahead = set(self.attn_out) | ({self.an.attentions[0].node} if span else set())
            need = ancestors(q_roots(self.an, self.ph.tail), self._stop(), self.ph.writes, {n: [] for n in ahead})
            nodes = [n for n in nodes if n in need]

        rowed = rowed_outputs(self.an)
        widened = self.an.halo != (0, 0)   # convolutions along the rows: a chunk runs on its rows and their halo
        replay = self._replayer(chunk) if not span and not widened else None

        def work(a: int, b: int) -> None:
            dyn = self._later_chunk(a)
            self._chunk = (a, b)
            lo, hi = max(0, a - self.an.halo[0]), min(self.rows, b + self.an.halo[1])
            if replay is not None and replay.takes(a, b):   # (with static rows: the dynamic rows, as every later chunk)
                env = replay.run(self._inputs(a, b, dyn), self._program(nodes, keep, a, b - a if dyn else None, keep))
            else:
                first = outs[self.an.outputs.index(rowed[0])] is None if rowed else False
                watch = set().union(*(self._watch([o], i in donate) for i, o in enumerate(self.an.outputs)
                                      if o in rowed)) if first and not widened else set()
                env = self._run(nodes, self._inputs(lo, hi, dyn), lo, keep, b - a if dyn else None,
                                {} if widened else self._dests(rowed, a, b), watch)
            for i, o in enumerate(self.an.outputs):
                if not isinstance(o, fx.Node):
                    outs[i] = o
                    continue
                val = env[o] if o in env else self.consts.get(o, self.base.get(o))
                if val is None and o in self.cache:
                    val = self.cache[o]
                r = self.an.rows.get(o)
                if isinstance(r, Rows):
                    if widened:   # its own rows of the widened chunk's (no static rows beside them)
                        val = val.narrow(r.dim, a - lo, b - a)
                    if outs[i] is None:
                        outs[i] = donate.get(i) if i in donate else whole_buffer(val, r, self.rows)
                        if not widened:
                            self._found(o, env, outs[i], r)
                    write_chunk_rows(outs[i], val, r, self.rows, a, b, a == 0)
                else:
                    outs[i] = val

        if not span:
            for a, b in chunk_bounds(self.rows, chunk, self.cap.min_rows):
                attempt(work, a, b, self._retries)
            self._close(replay)
        else:
            att = self.an.attentions[0]
            q_nodes, store = self._q_nodes(att), self.stores[att.node]
            for s0, s1 in chunk_bounds(self.rows, span, self.cap.min_rows):
                q = self._q_rows(att, q_nodes, s0, s1, chunk)
                self.attn_out[att.node] = self.attend_store(q, store, q_offset=s0, causal=att.causal, scale=att.scale)
                del q
                self._base = s0
                held = self._held_rows(att, s0)
                self._held_static = (held.pre, held.post)
                for a, b in chunk_bounds(s1 - s0, chunk, self.cap.min_rows):
                    attempt(work, s0 + a, s0 + b, self._retries)
                del self.attn_out[att.node]
            self._base, self._held_static = 0, (0, 0)
        if self.ph.tail:
            self._run_tail(outs)
        self.kv.clear()
        self._into.clear()   # they hold the K/V and output buffers: not past the call
        self.attn_out.clear()
        for store in self.stores.values():
            store.release()
        self.stores.clear()
        return pytree.tree_unflatten(outs, self.cap.out_spec)
