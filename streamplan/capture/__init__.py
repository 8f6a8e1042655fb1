"""The generic way in: a block's forward captured to an ATen graph with the row count symbolic, analysed for its
row-local ops and global attentions, and run in row chunks (see ``analyze`` and ``execute``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from .analyze import Analysis, analyze
from .execute import Phases, phases
from .export import Captured, capture, rows_of_call, signature


@dataclass(eq=False)
class Streamable:
    """A capture that can run in row chunks: the graph, its analysis, its phases."""

    captured: Captured
    analysis: Analysis
    phases: Phases

    @functools.cached_property
    def mlp_regions(self) -> list:
        """The graph's feature-sliceable MLPs (L2), found once per capture."""
        from .mlp import find_regions
        return find_regions(self.phases.q, self.analysis)

    @property
    def static_rows(self) -> int:
        return max((a.kv_rows.pre + a.kv_rows.post for a in self.analysis.attentions), default=0)


_CACHE: dict[tuple, Any] = {}


def streamable(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> tuple[Streamable | str, bool]:
    """The capture for this call (cached per class and input signature), or why it cannot stream; and whether this
    call captured (rather than reusing a capture)."""
    key = signature(module, args, kwargs, rows)
    if key in _CACHE:
        found = _CACHE[key]
        if isinstance(found, Streamable) and found.captured.inputs and any(
                k == "constant" for k, _ in found.captured.inputs) and found.captured.notes[:1] != [str(id(module))]:
            pass  # a constant tensor captured from another instance: capture this one on its own below
        else:
            return found, False
    cap = capture(module, args, kwargs, rows)
    if isinstance(cap, str):
        _CACHE[key] = cap
        return cap, True
    placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    user = {n for n, (kind, _) in zip(placeholders, cap.inputs) if kind == "user"}
    an = analyze(cap.graph, cap.row_symbol, user)
    if isinstance(an, str):
        found: Streamable | str = f"{an} (captured in {cap.seconds:.2f} s)"
    else:
        ph = phases(cap, an)
        twice = an.input_writes & {n for kv in ph.kv for n in kv}
        found = Streamable(cap, an, ph) if not twice else (
            f"{_op(next(iter(twice)))} writes into the block's input before its attention reads it (chunked, that "
            f"write would run in both phases)")
        if any(k == "constant" for k, _ in cap.inputs):
            cap.notes.insert(0, str(id(module)))
    _CACHE[key] = found
    return found, True


def _op(node) -> str:
    packet = getattr(node.target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(node.target)


__all__ = ["Streamable", "streamable", "rows_of_call", "Captured", "Analysis"]
