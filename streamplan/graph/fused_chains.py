"""Exact fused chains: a run of a chunk's element-wise ops, each one IEEE-rounded operation (add, sub, mul, neg, a dtype
conversion) or data movement (views, ``cat``, a gather), compiled by Inductor into one kernel that rounds every
intermediate to the dtype eager gives it (``emulate_precision_casts``). Why: eager PyTorch runs an op over a strided
view or with a broadcast operand element by element (a rotary's ``x[..., :96] * cos``), much slower per byte than a
dense op, and each op is one more pass over memory; one kernel reads the run's inputs once and writes what leaves it
once, bit for bit as eager computes it (a partial rotary, the common case, is much faster fused than as joins built in
place).

Exactness is checked, not assumed: before a compiled chain is used, it and its eager ops run on the first chunk's
leading rows and must agree bit for bit; a chain that differs, or does not compile, runs eager (``handle.report()``
says so). Divisions and transcendental functions are left out: their compiled forms may round otherwise. The memory
model prices the chains as eager runs them (never less than fused), so a plan holds either way."""
from __future__ import annotations

import functools
import importlib.util
import logging
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake

from .analyze import Analysis, Rows, op_name, numel_besides, written_args
from .row_pieces import dynamic_rows, deaths, is_view

log = logging.getLogger(__name__)

# one IEEE rounding per element (or none), in eager and in Inductor's code alike
EXACT_OPS = {"add", "sub", "rsub", "mul", "neg", "_to_copy", "to", "type_as", "clone", "cat", "index_select",
             "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
             "expand_as", "alias", "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind",
             "unflatten", "flatten", "movedim", "contiguous"}
CHECK_ROWS = 16   # the leading rows of a first chunk a chain is checked on
# below this many bytes of a chain's outputs per chunk its eager kernels take microseconds, and a compiled call's fixed
# host time per call would be what a host-bound chunk waits on: left eager. An estimate, not a measured crossover
MIN_BYTES = 64 << 20


@dataclass
class Compiled:
    """One chain's compiled form, shared by every chain with the same code (a model's blocks): whether it held."""

    fn: Callable
    ok: bool | None = None   # None: not checked yet
    why: str = ""


@dataclass(eq=False)
class FusedChain:
    nodes: list[fx.Node]      # in graph order
    inputs: list[fx.Node]     # values from outside the chain its nodes read
    outputs: list[fx.Node]    # its values read after it (or kept)
    marker: fx.Node           # where the schedule runs it (its last node)
    code: str                 # the chain as a graph's code and its inputs' dtypes: the compiled form's key
    graph: fx.GraphModule
    dead: dict[int, list[fx.Node]]   # run eager: after which node a value is no longer needed (outputs excepted)
    row_bytes: int            # bytes per row of its outputs
    prelude: list[fx.Node] = field(default_factory=list)   # (``row_pieces.schedule`` reads these: none here)
    post: list[fx.Node] = field(default_factory=list)

    @property
    def ops(self) -> str:
        return ", ".join(dict.fromkeys(op_name(n.target) for n in self.nodes if n.target is not operator.getitem))


_COMPILED: dict[tuple[str, str], Compiled] = {}


def available(device: torch.device) -> bool:
    """Inductor can fuse here: CUDA with Triton (``fuse=None`` fuses only there; ``fuse=True`` anywhere)."""
    return device.type == "cuda" and _has_triton() and not _dynamo_disabled()


def _dynamo_disabled() -> bool:
    """``TORCHDYNAMO_DISABLE=1`` or ``TORCH_COMPILE_DISABLE=1`` (dynamo's ``config.disable``): ``torch.compile``
    returns what it was given."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return True
    try:
        import torch._dynamo
        return bool(getattr(torch._dynamo.config, "disable", False))
    except Exception:   # noqa: BLE001  (a torch without the flag: it cannot be disabled that way)
        return False


@functools.cache
def _has_triton() -> bool:   # asked once: a failed import is not remembered, and blocks ask on every call
    return importlib.util.find_spec("triton") is not None


def _member(n: fx.Node, an: Analysis, attention: set) -> bool:
    if n.op != "call_function" or n in attention or n in an.const:
        return False
    if n.target is operator.getitem:
        return dynamic_rows(an.rows.get(n))
    if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "aten":
        return False
    if op_name(n.target) not in EXACT_OPS or written_args(n):
        return False
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return dynamic_rows(an.rows.get(n))


def find_chains(nodes: list[fx.Node], an: Analysis, keep: set, extra: dict | None = None,
                exclude: frozenset = frozenset()) -> list[FusedChain]:
    """The chains among ``nodes`` (a phase as it is scheduled) worth a kernel: consecutive members with at least two
    ops that are not views. Members have the chunk's rows alone (never static rows), so a chain is the same computation
    on a first chunk and on the dynamic rows of the later ones; ``exclude``: nodes that pass rows through otherwise
    there (a cut along the rows). None where the block writes into its inputs (as ``row_pieces``)."""
    if an.input_writes:
        return []
    attention = {a.node for a in an.attentions} | {r.node for r in an.reduced} | set(exclude)
    chains, seg = [], []
    for i, n in enumerate(nodes + [None]):
        if n is not None and _member(n, an, attention):
            seg.append(n)
            continue
        if sum(not is_view(m) for m in seg) >= 2:
            chain = _chain(seg, nodes[i:], keep, extra or {}, an)
            if chain is not None:
                chains.append(chain)
        seg = []
    return chains


def _chain(members: list[fx.Node], after: list[fx.Node], keep: set, extra: dict,
           an: Analysis) -> FusedChain | None:
    mset = set(members)
    want = set(keep)
    for n in after:
        want.update(n.all_input_nodes)
        want.update(extra.get(n, ()))
    outputs = [n for n in members if n in want]
    if not outputs or any(not isinstance(n.meta.get("val"), torch.Tensor) for n in outputs):
        return None
    inputs = list(dict.fromkeys(m for n in members for m in n.all_input_nodes if m not in mset))
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, m in enumerate(inputs):
        env[m] = g.placeholder(f"in{i}")
    for n in members:
        env[n] = g.node_copy(n, lambda m: env[m])
    g.output(tuple(env[o] for o in outputs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    dtypes = [str(getattr(m.meta.get("val"), "dtype", "")) for m in inputs]
    return FusedChain(members, inputs, outputs, members[-1] if members[-1] in outputs else outputs[-1],
                      gm.code + repr(dtypes), gm, deaths(members, outputs),
                      sum(numel_besides(o.meta["val"], an.rows[o].dim) * o.meta["val"].element_size()
                          for o in outputs))


def _compiled(chain: FusedChain, device: torch.device) -> Compiled:
    key = (chain.code, device.type)
    c = _COMPILED.get(key)
    if c is None:
        # sizes static at first, then those that changed (the rows) symbolic: the features stay static, so the kernel
        # knows its rows' alignment (with every dimension symbolic a gathered modulation chain runs slower)
        c = _COMPILED[key] = Compiled(torch.compile(chain.graph, dynamic=None, fullgraph=True,
                                                    options={"emulate_precision_casts": True}))
    return c


def _local(chain: FusedChain, env: dict, an: Analysis, symbol, rows: int) -> list:
    """The chain's inputs on the chunk's first ``rows`` rows (sizes that count the rows count those)."""
    out = []
    for m in chain.inputs:
        v, r = env[m], an.rows.get(m)
        if isinstance(r, Rows) and isinstance(v, torch.Tensor):
            v = v.narrow(r.dim, 0, rows)
        elif isinstance(r, list) and isinstance(v, (list, tuple)):   # a split's outputs, each with its rows or none
            v = type(v)(t.narrow(p.dim, 0, rows) if isinstance(p, Rows) and isinstance(t, torch.Tensor) else t
                        for t, p in zip(v, r))
        elif isinstance(m.meta.get("val"), torch.SymInt) and symbol in m.meta["val"].node.expr.free_symbols:
            v = int(m.meta["val"].node.expr.subs(symbol, rows))
        out.append(v)
    return out


def _same(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def _check(chain: FusedChain, c: Compiled, env: dict, an: Analysis, symbol, call) -> None:
    """Compiled and eager on the chunk's leading rows, bit for bit (NaN where NaN)."""
    rows = next((env[m].shape[an.rows[m].dim] for m in chain.inputs
                 if isinstance(an.rows.get(m), Rows) and isinstance(env[m], torch.Tensor)), None)
    if rows is None:
        c.ok, c.why = False, "no input with rows to check it on"
        return
    if _dynamo_disabled():   # torch.compile would hand back the chain's own graph, run op by op
        c.ok, c.why = False, "torch.compile is disabled here (TORCHDYNAMO_DISABLE or TORCH_COMPILE_DISABLE)"
        return
    ins = _local(chain, env, an, symbol, min(rows, CHECK_ROWS))
    local = dict(zip(chain.inputs, ins))
    started = time.perf_counter()
    log.info("compiling a chain of %s (once per process, shared by identical chains)", chain.ops)
    try:
        for n in chain.nodes:
            local[n] = call(n, local)
        got = c.fn(*ins)
    except Exception as exc:   # noqa: BLE001  (Inductor/Triton missing or failing: the chain runs eager)
        first = str(exc).splitlines()[0][:120] if str(exc) else ""
        c.ok, c.why = False, f"not compiled ({type(exc).__name__}: {first})"
        log.info("chain %s kept eager: %s", chain.ops, c.why)
        return
    bad = [o for o, v in zip(chain.outputs, got) if not _same(v, local[o])]
    c.ok = not bad
    c.why = "" if c.ok else "its compiled form differed from its eager ops"
    log.info("chain of %s: compiled in %.1f s, %s", chain.ops, time.perf_counter() - started,
             "bit for bit its eager ops" if c.ok else f"kept eager: {c.why}")


def run_chain(chain: FusedChain, env: dict, an: Analysis, symbol, call, device: torch.device) -> None:
    """The chain on one chunk: compiled where it held on its check, its nodes one by one otherwise."""
    c = _compiled(chain, device)
    if c.ok is None and not _fake(chain, env):   # a rehearsal's fake inputs hold no values to check it on
        _check(chain, c, env, an, symbol, call)
    if c.ok:
        env.update(zip(chain.outputs, c.fn(*(env[m] for m in chain.inputs))))
        return
    local = {m: env[m] for m in chain.inputs}
    for i, n in enumerate(chain.nodes):
        local[n] = call(n, local)
        for m in chain.dead.get(i, ()):
            local.pop(m, None)
    env.update((o, local[o]) for o in chain.outputs)


def _fake(chain: FusedChain, env: dict) -> bool:
    return any(is_fake(env[m]) for m in chain.inputs if isinstance(env[m], torch.Tensor))


def state(chain: FusedChain, device: torch.device) -> Compiled | None:
    return _COMPILED.get((chain.code, device.type))
