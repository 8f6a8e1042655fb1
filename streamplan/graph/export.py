"""Capture: a block's forward traced once to an ATen graph with its row count symbolic (``torch.export``), cached per
class and input signature and reused for every block of that class with its own parameters."""
from __future__ import annotations

import gc
import inspect
import logging
import re
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Iterator, NamedTuple

import sympy
import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..registries import ARGUMENT_RECORDS, CAPTURE_CONTEXTS, CAPTURE_STATE_ATTRS
from .opaque_layers import OpaqueRefused
from .autocast_regions import inline_autocast_off
from .grid_rows import Grid, grid_forward, grid_of_call, row_argument
from .cache_views import CacheView, view_children

log = logging.getLogger("streamplan")

MAX_ROWS = 1 << 26
MIN_ROWS_RETRY = 256


@dataclass(eq=False)
class Captured:
    """One exported forward: the graph, what each placeholder is, and how long the capture took."""

    program: Any                      # torch.export.ExportedProgram
    graph: torch.fx.Graph
    inputs: list[tuple[str, str]]     # per placeholder, in order: (kind, target or user-input index)
    in_spec: Any
    out_spec: Any
    row_symbol: Any                   # the sympy symbol of the row count
    seconds: float
    min_rows: int = 2                 # the fewest rows the capture is valid for: no chunk is smaller
    autocast_off: frozenset = frozenset()   # device types whose autocast regions that turn it off were inlined
    row_unit: int = 1                 # rows per step of the symbol (a grid's width: rows = unit * lines, ``grid_rows``)
    max_rows: int | None = None       # the most rows it holds for, where the trace narrowed the count (a loop over
    #                                   fixed-size pieces of the rows, run once); None: any count

    def holds_for(self, rows: int) -> bool:
        """Whether the trace holds at ``rows`` rows: the range the export solved for its symbol."""
        return rows >= self.min_rows and (self.max_rows is None or rows <= self.max_rows)

    def size_at(self, size: Any, rows: int) -> int:
        """A size of the graph (an int, or a SymInt of the row count) at a call of ``rows`` rows."""
        return int(size.node.expr.subs(self.row_symbol, sympy.Rational(rows, self.row_unit))) \
            if isinstance(size, torch.SymInt) else int(size)


def rows_of_call(args: tuple, kwargs: dict) -> int | None:
    """The row count of a block call: dim 1 of its first [batch, rows, features] tensor, or dim 0 of a
    sequence-first [rows, 1, features] one, or with neither, of its longest packed [tokens, features] stream (the
    capture marks every size equal to it as the rows, wherever it is)."""
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    for leaf in leaves:
        if leaf.dim() == 3:
            return leaf.shape[0] if _sequence_first(leaf) else leaf.shape[1]
    return _packed_rows(leaves)


def _packed_rows(leaves: list[torch.Tensor]) -> int | None:
    """With no 3-D input, packed unbatched [tokens, features] streams (a text prefix beside the generated rows, their
    rotary tables beside them): the rows are the longest stream's (every size equal to it is then the rows, as for
    the 3-D rule)."""
    return max((t.shape[0] for t in leaves if t.dim() == 2 and t.shape[0] >= SEQUENCE_FIRST_MIN
                and t.is_floating_point()), default=None)


SEQUENCE_FIRST_MIN = 16   # a [rows, 1, features] input is sequence-first from this many rows (fewer: a batch)


def _sequence_first(t: torch.Tensor) -> bool:
    return t.shape[1] == 1 and t.shape[0] >= SEQUENCE_FIRST_MIN


def rows_problem(args: tuple, kwargs: dict) -> str:
    """Why a call has no rows to stream, in the report's words (``rows_of_call`` found fewer than two)."""
    first = next((leaf for leaf in pytree.tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor) and leaf.dim() == 3), None)
    if first is None:
        return "no [batch, rows, features] input (nor a packed [tokens, features] one) to take rows from"
    if first.shape[0] > 1 >= first.shape[1]:
        return (f"its first 3-D input is {tuple(first.shape)}: a sequence-first [rows, batch, features] layout "
                "(rows are read from dim 1 of [batch, rows, features]) is not streamed")
    return f"{first.shape[1]} row(s) in its first [batch, rows, features] input: nothing to stream"


def joined_offsets(args: tuple, kwargs: dict, rows: int) -> set[int]:
    """Static row counts that may be joined to the rows in an input (a rotary table may cover text + image rows:
    ``[T + N, d]``): the sequence lengths (dim 1) of the call's other 3-D tensors."""
    return {leaf.shape[1] for leaf in pytree.tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor) and leaf.dim() == 3 and 0 < leaf.shape[1] != rows}


def _size_key(s: int, rows: int, offsets: set[int]):
    if s == rows:
        return "N"
    if s - rows in offsets:
        return f"N+{s - rows}"
    return s


def _records(args: tuple, kwargs: dict) -> None:
    """Register as pytree nodes the declared argument records (``ir.register_argument_record``) among the call's
    leaves, so they flatten into their tensor fields (before the cache signature and the export see them)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        cls = type(leaf)
        if f"{cls.__module__}:{cls.__qualname__}" in ARGUMENT_RECORDS and is_dataclass(cls) and \
                cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
            _records(args, kwargs)   # a record inside a record
            return


def _is_record(x: object) -> bool:
    cls = type(x)
    return f"{cls.__module__}:{cls.__qualname__}" in ARGUMENT_RECORDS and cls in pytree.SUPPORTED_NODES


def _dyn_leaf(x: object) -> bool:
    return isinstance(x, (torch.Tensor, CacheView)) or x is None or _is_record(x)


def signatures(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> tuple[tuple, tuple]:
    """The call's ``signature``, and the one with a grid's line count abstracted (``_lines_abstracted``: the key a
    grid capture is kept under; the same where the call has no grid)."""
    own = signature(module, args, kwargs, rows)
    abstracted = _lines_abstracted(module, args, kwargs, rows)
    if abstracted is None:
        return own, own
    return own, signature(module, *abstracted, rows, offsets=joined_offsets(args, kwargs, rows))


def signature(module: nn.Module, args: tuple, kwargs: dict, rows: int, offsets: set[int] | None = None) -> tuple:
    """What a capture depends on: the class and forward, each leaf's shape with the row count abstracted, dtypes,
    devices, the non-tensor leaves, and the call's structure."""
    _records(args, kwargs)
    offsets = joined_offsets(args, kwargs, rows) if offsets is None else offsets
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(_size_key(s, rows, offsets) for s in leaf.shape), leaf.dtype, leaf.device.type,
                        leaf.requires_grad))
        elif isinstance(leaf, (int, float, bool, str, type(None))):
            sig.append(leaf)
        else:
            sig.append(type(leaf).__name__)
    fwd = type(module).forward
    return (type(module), getattr(fwd, "__code__", fwd), str(spec), tuple(sig), structure(module))


def _lines_abstracted(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> tuple[tuple, dict] | None:
    """The call with a grid's line count (``grid_rows``: the height an image plane's rows are unflattened to) as
    "lines", as the row count is abstracted: its capture computes it from the rows, so every height shares one; None
    where the call has no grid."""
    call = _bound_call(module, args, kwargs)
    grid = _grid(call, rows) if not isinstance(call, str) else None
    if grid is None:
        return None
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    bound.arguments[grid.leading] = grid.with_lines(bound.arguments, "lines")
    return bound.args[1:], bound.kwargs


_SIMPLE = (int, float, bool, str, type(None))




def _plain(v: object) -> object:
    """A simple value, or a tuple, list or str-keyed dict of simple values, as something hashable; else None."""
    if isinstance(v, _SIMPLE):
        return (v,)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _SIMPLE) for x in v):
        return tuple(v)
    if isinstance(v, dict) and all(isinstance(a, str) and isinstance(x, _SIMPLE) for a, x in v.items()):
        return tuple(sorted(v.items()))
    return None


def structure(module: nn.Module) -> tuple:
    """What else a capture depends on: every submodule's class and plain settings (eps, flags, activation names,
    its attention processor's class), parameters' and buffers' names, shapes and dtypes. Two blocks of one class
    built differently (SD3.5's dual attention, a norm without affine weights) must not share a capture."""
    out = []
    for name, m in module.named_modules():
        plain = []
        for k, v in sorted(vars(m).items()):
            if k == "training":
                continue
            if k.startswith("_"):   # private state a library declares its forward reads (ir.register_capture_state)
                if k in CAPTURE_STATE_ATTRS and _plain(v) is not None:
                    plain.append((k, _plain(v)))
                continue
            if _plain(v) is not None:   # simple tables too (a LoRA layer's per-adapter scaling, baked into the graph)
                plain.append((k, _plain(v)))
            elif not isinstance(v, (torch.Tensor, nn.Module, dict, list)) and not callable(v):
                plain.append((k, type(v).__qualname__))   # a processor or config object: its class
            elif callable(v) and not isinstance(v, nn.Module):
                plain.append((k, getattr(v, "__qualname__", type(v).__qualname__)))
        out.append((name, type(m).__qualname__, tuple(plain)))
    out.extend((n, tuple(t.shape), t.dtype) for n, t in module.named_parameters())
    out.extend((n, tuple(t.shape), t.dtype) for n, t in module.named_buffers())
    return tuple(out)


def _export(export, module: nn.Module, args: tuple, kwargs: dict, dynamic: dict) -> tuple[Any, bool]:
    """``torch.export`` at this call. Where export cannot prove a guard on the row count for every count
    ("Constraints violated (rows)": torch 2.11 cannot prove ``min(16*rows, 32*rows) == 16*rows`` from
    the reshape of an expanded K/V that eager grouped-query attention makes), the trace is taken once more with
    the guards left in the graph as assertions, and kept only if sympy proves each of them for every positive count
    (the executors do not run assertions). Also whether a trace failed on the way (``capture`` then collects the
    reference cycles a failed trace leaves)."""
    with torch.no_grad(), ExitStack() as contexts:
        for context in CAPTURE_CONTEXTS:   # what a block's library swaps while it is traced (ir)
            held = context(module)
            if held is not None:
                contexts.enter_context(held)
        try:
            return export(module, tuple(args), dict(kwargs), dynamic_shapes=dynamic, strict=False), False
        except Exception as exc:  # noqa: BLE001 -- only the constraint failure is retried
            if "Constraints violated" not in str(exc):
                raise
        # retried outside the handler: the failure's traceback is let go before the second trace
        program = export(module, tuple(args), dict(kwargs), dynamic_shapes=dynamic, strict=False,
                         prefer_deferred_runtime_asserts_over_guards=True)
        unproven = _unproven_assertion(program.graph)
        if unproven is not None:
            raise RuntimeError(f"a guard on the row count that holds only for some counts: {unproven}")
        return program, True


_NO_MESSAGE = "inside torch.export's guard on the row count, with no message"



def _reason(exc: Exception) -> str:
    if isinstance(exc, OpaqueRefused):   # a module of a known kind that may not run by chunks: its own reason
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if re.fullmatch(r"[-+0-9./e ]+", text):   # a bare number out of torch's own guard code: nothing a user can read
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and "_sympy" in frames[-1].filename:   # torch's own shape arithmetic on the row count
            # (the number is the sampled count's, different each capture: not said, so the reason is stable)
            text = ("inside torch's symbolic shape arithmetic on the row count: a fraction in a modulus (a "
                    "size the block computes from the rows is not a whole, positive count for every row count)")
        else:
            text = f"{_NO_MESSAGE} (a shape that holds for some counts)"
    return f"capture failed ({type(exc).__name__}: {text[:200]})"


def _unproven_assertion(graph: torch.fx.Graph) -> str | None:
    """The first runtime assertion over the row count that sympy cannot prove for every positive count, or None."""
    for node in graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default:
            continue
        cond = node.args[0]
        val = cond.meta.get("val") if isinstance(cond, torch.fx.Node) else cond
        if isinstance(val, bool) and val:
            continue
        if not isinstance(val, torch.SymBool) or not provable(val.node.expr):
            return str(val.node.expr if isinstance(val, torch.SymBool) else val)
    return None


def provable(expr) -> bool:
    """Whether a sympy condition over row counts holds for every positive integer count."""
    import sympy
    for name, fn in (("Min", sympy.Min), ("Max", sympy.Max)):   # torch's own Min/Max do not simplify
        expr = expr.replace(lambda e, n=name: isinstance(e, sympy.Basic) and type(e).__name__ == n,
                            lambda e, f=fn: f(*e.args))
    positive = {sym: sympy.Symbol(f"{sym}_p", integer=True, positive=True) for sym in expr.free_symbols}
    return sympy.simplify(expr.subs(positive)) is sympy.true


def capture(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> Captured | str:
    """Export ``module`` at this call with every dimension of size ``rows`` made one symbolic row count. Runs on
    fake tensors: nothing the size of the call is allocated."""
    from torch.export import export

    _records(args, kwargs)
    problem = _untraceable_argument(args, kwargs)
    if problem is not None:
        return problem
    call = _bound_call(module, args, kwargs)
    if isinstance(call, str):
        return call
    trace = _Trace(module, args, kwargs, call.arguments, rows, joined_offsets(args, kwargs, rows))
    trace.grid = _grid(call, rows)
    start = time.perf_counter()
    try:
        with _class_forward(module, call), grid_forward(module, trace.grid, *(row_argument(call.arguments, rows)
                                                                            or (None, 0))):
            exported = trace.first_export(export)
        if isinstance(exported, str) and trace.grid is not None:   # no grid after all: the plain capture
            trace.grid = None
            with _class_forward(module, call):
                exported = trace.first_export(export)
    finally:
        # a trace that failed inside torch.export leaves reference cycles among its frames; through their callers
        # they keep the streamed call that captured (its inputs, K/V and output buffers) alive until the cycle
        # collector runs, and the next operation is planned under a budget that memory still takes: collected now,
        # only where a trace failed (a full collection is too slow to run after every capture; docs/design.md,
        # Capture)
        if trace.failed:
            gc.collect()
    seconds = time.perf_counter() - start
    if isinstance(exported, str):
        return exported
    program, min_rows = exported
    cap = _captured(module, program, seconds, min_rows)
    if isinstance(cap, Captured) and trace.grid is not None:
        cap.row_unit = trace.grid.unit
    if isinstance(cap, Captured):   # a range narrowed by a guard export kept as the symbol's range
        upper = getattr(program.range_constraints.get(cap.row_symbol), "upper", None)
        if upper is not None and upper.is_finite and int(upper) < MAX_ROWS // cap.row_unit:
            cap.max_rows = int(upper) * cap.row_unit
    return cap


def _grid(call: "_BoundCall", rows: int) -> Grid | None:
    """The call's rows as a grid of whole lines (``grid_rows``), where int arguments give its extents and no
    keywords pass through ``**kwargs``."""
    return grid_of_call(call.arguments, rows) if not call.extra and row_argument(call.arguments, rows) else None


def _untraceable_argument(args: tuple, kwargs: dict) -> str | None:
    """Why export cannot take this call's arguments (it takes tensors and plain values only), or None."""
    odd = [type(leaf).__name__ for leaf in pytree.tree_leaves((args, kwargs))
           if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None)))]
    if odd:   # a cache object not declared a read cache (``cache_views``), a flex BlockMask
        return (f"an argument of type {odd[0]} the capture cannot take (it takes tensors, plain values and declared "
                "records and read caches)")
    return None


class _BoundCall(NamedTuple):
    """A call bound to its forward's parameters, as export is given it."""

    arguments: dict[str, Any]       # by parameter name, ``self`` left out, ``**kwargs``' keywords among them
    signature: inspect.Signature    # the class forward's
    extra: dict[str, Any]           # the keywords the forward takes only through its ``**kwargs``


def _bound_call(module: nn.Module, args: tuple, kwargs: dict) -> _BoundCall | str:
    """The call bound to the class forward's parameters (export's dynamic shapes are given per parameter), or why
    it does not bind."""
    try:
        bound = dict(inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments)
        bound.pop(next(iter(bound)))   # self
    except TypeError as exc:
        return f"the call does not match its forward's signature ({exc})"
    # keywords the forward takes only through its ``**kwargs`` (transformers' ``use_cache=False``, Cohere 2's
    # ``position_ids``): torch.export lists them both alone and inside the ``**kwargs`` dict and then fails to match
    # the dynamic shapes ("Must provide a tree_name"), so they are traced as named keyword parameters of the forward
    fwd_sig = inspect.signature(type(module).forward)
    var_kw = next((p.name for p in fwd_sig.parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD), None)
    extra = bound.pop(var_kw) if var_kw in bound else {}
    bound.update(extra)
    return _BoundCall(bound, fwd_sig, extra)


@contextmanager
def _class_forward(module: nn.Module, call: _BoundCall) -> Iterator[None]:
    """The class forward in place while the module is traced: streamplan's own wrapper (an instance ``forward``)
    set aside, and where the call passes keywords through ``**kwargs``, a forward that names them (``_bound_call``)."""
    installed = module.__dict__.pop("forward", None)   # streamplan's own wrapper: trace the class forward
    if call.extra:
        cls_forward = type(module).forward

        def named_forward(*a, **kw):
            return cls_forward(module, *a, **kw)

        fwd_sig = call.signature
        named_forward.__signature__ = fwd_sig.replace(parameters=[
            p for p in list(fwd_sig.parameters.values())[1:] if p.kind != inspect.Parameter.VAR_KEYWORD] + [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in call.extra])
        module.forward = named_forward
    try:
        yield
    finally:
        if call.extra:
            del module.forward
        if installed is not None:
            module.forward = installed


def _dynamic_shapes(arguments: dict[str, Any], dim: Any, rows: int, offsets: set[int], joined: bool) -> dict:
    """Export's dynamic shapes for the bound call: every dimension of size ``rows`` is ``dim``, and with ``joined``
    every dimension of ``rows`` + another input's sequence length is ``dim`` + that length."""
    def dyn(leaf: object) -> Any:
        if _is_record(leaf):   # export takes a dataclass's dynamic shapes as the list of its fields'
            return [pytree.tree_map(dyn, getattr(leaf, f.name), is_leaf=_dyn_leaf) for f in fields(leaf)]
        if isinstance(leaf, CacheView):   # and a cache view's as the list of its children's
            return [pytree.tree_map(dyn, v, is_leaf=_dyn_leaf) for v in view_children(leaf)]
        if isinstance(leaf, torch.Tensor):
            return {i: (dim if s == rows else dim + (s - rows)) for i, s in enumerate(leaf.shape)
                    if s == rows or (joined and s - rows in offsets)} or None
        return None

    return {k: pytree.tree_map(dyn, v, is_leaf=_dyn_leaf) for k, v in arguments.items()}


@dataclass(eq=False)
class _Trace:
    """The export attempts of one call, and whether a trace failed inside torch.export on the way (``capture``
    then collects the reference cycles it leaves)."""

    module: nn.Module
    args: tuple
    kwargs: dict
    arguments: dict[str, Any]
    rows: int
    offsets: set[int]
    failed: bool = False
    grid: Grid | None = None   # rows unflattened to whole lines: the row count is ``unit * lines``, lines symbolic

    def attempts(self) -> list[tuple[bool, int]]:
        """(rows joined to static rows, the fewest rows) per attempt, in order. First with dimensions of size rows +
        (another input's sequence length) as the rows joined to static rows (Flux's rotary over text + image), then,
        if that fails, with the exact row count alone. A trace may assume more rows than two (a kernel's block size:
        "128/5 <= rows" seen with torch 2.11 on CUDA): then the capture is retried valid from MIN_ROWS_RETRY rows
        on, and chunks never go below that."""
        rows, offsets = self.rows, self.offsets
        tries = (True, False) if any(_size_key(s, rows, offsets) not in ("N", s) for leaf in pytree.tree_leaves(
            (self.args, self.kwargs)) if isinstance(leaf, torch.Tensor) for s in leaf.shape) else (False,)
        lows = (2, MIN_ROWS_RETRY) if rows >= 2 * MIN_ROWS_RETRY else (2,)
        return [(joined, lo) for lo in lows for joined in tries]

    def first_export(self, export: Callable[..., Any]) -> tuple[Any, int] | str:
        """The first attempt that exports, with the fewest rows it is valid for; or the first failure's reason, as
        text (an exception kept would keep its traceback's frames)."""
        from torch.export import Dim
        first_reason = ""
        tries = self.attempts()
        for joined, lo in tries:   # never none; one more where a guard names the fewest rows (``_guarded_retry``)
            dim = Dim("rows", min=lo, max=MAX_ROWS)
            if self.grid is not None:   # whole lines: at least two in a chunk
                lines = max(2, -(-lo // self.grid.unit))
                dim, lo = self.grid.unit * Dim("lines", min=lines, max=MAX_ROWS // self.grid.unit), \
                    lines * self.grid.unit
            dynamic = _dynamic_shapes(self.arguments, dim, self.rows, self.offsets, joined)
            try:
                program, failed = _export(export, self.module, self.args, self.kwargs, dynamic)
                self.failed = failed or bool(first_reason)
                return program, lo
            except Exception as exc:  # noqa: BLE001 -- any capture failure keeps the module stock, with the reason
                reason, self.failed = _reason(exc), True   # the first, unless a later attempt says what it was
                if not first_reason or (_NO_MESSAGE in first_reason and _NO_MESSAGE not in reason):
                    first_reason = reason
                tries += _guarded_retry(str(exc), joined, tries, self.rows)
        return first_reason


def _guarded_retry(reason: str, joined: bool, tries: list[tuple[bool, int]], rows: int) -> list[tuple[bool, int]]:
    """One more attempt valid from the fewest rows a guard asks for (rows cut at a fixed count: the rows past the
    cut must exist, ``guarded_rows.least_rows``), where this call has that many and no later attempt asks as many;
    chunks never go below it."""
    from .guarded_rows import least_rows
    least = least_rows(reason)
    if least is None or least > rows or any(j == joined and lo >= least for j, lo in tries):
        return []
    return [(joined, least)]


def _captured(module: nn.Module, program: Any, seconds: float, min_rows: int) -> Captured | str:
    """The exported program as the executors run it, or why they cannot (it writes in place, takes an input they do
    not feed, or no input dimension became the row count)."""
    inputs = _placeholder_kinds(program)
    if isinstance(inputs, str):
        return inputs
    symbol = _row_symbol(program.graph)
    if symbol is None or not getattr(symbol, "is_Symbol", False):
        return "no input dimension became the symbolic row count"
    try:
        autocast_off = inline_autocast_off(program.graph, program.graph_module)
    except RuntimeError as exc:
        return str(exc)
    log.info("streamplan: captured %s in %.2f s (%d graph nodes)", type(module).__name__, seconds,
             len(program.graph.nodes))
    return Captured(program, program.graph, inputs, program.call_spec.in_spec, program.call_spec.out_spec, symbol,
                    seconds, min_rows=min_rows, autocast_off=autocast_off)


def _placeholder_kinds(program: Any) -> list[tuple[str, str]] | str:
    """Per placeholder what the executors feed it (a user input by index, a parameter, buffer or constant by name),
    or why they cannot run the program."""
    from torch.export.graph_signature import InputKind
    sig = program.graph_signature
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        return "its forward writes in place to an input or buffer"
    inputs, user = [], 0
    for s in sig.input_specs:
        if s.kind == InputKind.USER_INPUT:
            inputs.append(("user", user))
            user += 1
        elif s.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            inputs.append(("param" if s.kind == InputKind.PARAMETER else "buffer", s.target))
        elif s.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(("constant", s.target))
        else:
            return f"capture has an input of kind {s.kind.name} streamplan does not run"
    return inputs


def _row_symbol(graph: torch.fx.Graph) -> Any:
    """The sympy symbol of the row count: the first placeholder dimension that is rows + a constant."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt) and len(size.node.expr.free_symbols) == 1:
                    return next(iter(size.node.expr.free_symbols))   # rows + a constant: its symbol
    return None
