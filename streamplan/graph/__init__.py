"""The generic way in: a block's forward captured to an ATen graph with the row count symbolic, analysed for its
row-local ops and global attentions, and run in row chunks (see ``analyze``, ``phases`` and
``streamplan.execute.graph_run``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from . import cache_views, fixed_row_slices
from .contraction_phases import phase_kv_problem
from .analyze import Analysis, op_name, analyze
from .eager_attention import fuse_eager_attention
from .elementwise_pieces import split_read_in_pieces
from .phases import Phases, phases_of
from .reduced_attentions import reduce_static_queries
from .export import Captured, capture, rows_of_call, rows_problem, signatures
from .opaque_layers import running  # noqa: F401  (declares the opaque layers' op and capture context)


@dataclass(eq=False)
class Streamable:
    """A capture that can run in row chunks: the graph, its analysis, its phases."""

    captured: Captured
    analysis: Analysis
    phases: Phases

    @functools.cached_property
    def mlp_regions(self) -> list:
        """The graph's feature-sliceable MLPs (L2), found once per capture."""
        from .sliced_mlp import find_regions
        return [r for r in find_regions(self.phases.q, self.analysis)   # not on one side of a cut at a fixed count
                if not fixed_row_slices.touches_spans(self.analysis, r.nodes)]

    @property
    def static_rows(self) -> int:
        return max((a.kv_rows.pre + a.kv_rows.post for a in self.analysis.attentions), default=0)


_CACHE: dict[tuple, Any] = {}


def streamable(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> tuple[Streamable | str, bool]:
    """The capture for this call (cached per class and input signature), or why it cannot stream; and whether this
    call captured (rather than reusing a capture)."""
    viewed = cache_views.viewed(args, kwargs)   # idempotent: the executor's call is viewed already
    if isinstance(viewed, str):
        return viewed, False
    args, kwargs = viewed
    # a grid's captures (its line count computed from the rows) serve every height: kept under a key with the height
    # abstracted; any other capture, which may have baked the call's ints in, under the call's own
    key, lines = signatures(module, args, kwargs, rows)
    # a capture that lifted a constant tensor (an unregistered tensor attribute) holds that instance's value: it is
    # kept under the instance as well, and other instances capture on their own
    for k in (lines + (id(module),), lines, key + (id(module),), key):
        if k in _CACHE:
            return _CACHE[k], False
    cap = capture(module, args, kwargs, rows)
    if isinstance(cap, str):
        _CACHE[key] = cap
        return cap, True
    if cap.row_unit > 1:
        key = lines
    fuse_eager_attention(cap.graph)   # attention written by hand: one op the analysis knows
    split_read_in_pieces(cap.graph)   # a per-row table read in pieces: each piece made where it is first read
    placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    user = {n for n, (kind, _) in zip(placeholders, cap.inputs) if kind == "user"}
    an = analyze(cap.graph, cap.row_symbol, user, unit=cap.row_unit, cuts=fixed_row_slices)
    if isinstance(an, str):
        found: Streamable | str = f"{an} (captured in {cap.seconds:.2f} s)"
    else:
        reduce_static_queries(an, cap.graph)
        ph = phases_of(cap, an)
        twice = an.input_writes & {n for kv in ph.kv for n in kv}
        unwidened = phase_kv_problem(an, cap.graph)   # phase KV's chunks are not widened by a halo
        found = unwidened or (Streamable(cap, an, ph) if not twice else (
            f"{op_name(next(iter(twice)).target)} writes into the block's input before its attention reads it "
            f"(chunked, that write would run in both phases)"))
    if any(k == "constant" for k, _ in cap.inputs):
        key = key + (id(module),)
    _CACHE[key] = found
    return found, True


__all__ = ["Streamable", "streamable", "rows_of_call", "rows_problem", "Captured", "Analysis"]
