"""A small table picked per row (AdaLN modulation: ``table.index_select(0, index)``, one index per row) over a chunk
whose rows all pick the same entry: that entry, one row, which the elementwise ops after it broadcast until they meet
a full-rows operand; not a chunk-sized copy of it and of every result between. Packed sequences are runs of rows of
one (timestep, modality), so most chunks lie inside one run. Bit for bit what the lookup gives: every element's
arithmetic is unchanged, only the repeated operand is not materialised. Where a lookup's value reaches anything but
such elementwise ops (a view, a GEMM, an output), it is looked up as stock does."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import fx

from .analyze import Analysis, Rows, _name, pointwise


@dataclass(eq=False)
class Lookup:
    node: fx.Node    # the index_select
    table: fx.Node   # rows-free: the same table for every chunk
    index: fx.Node   # a graph input, one index per row


def _elementwise(n: fx.Node) -> bool:
    return n.op == "call_function" and pointwise(n.target) and not _name(n.target).endswith("_")


def find_lookups(graph: fx.Graph, an: Analysis) -> dict[fx.Node, Lookup]:
    """The lookups whose every use is an elementwise op that either stays per-entry or meets a full-rows operand
    with its rows on the same axis (the broadcast then gives stock's shape)."""
    found = {}
    for n in graph.nodes:
        if n.op != "call_function" or _name(n.target) != "index_select" or len(n.args) != 3 or n.args[1] != 0:
            continue
        table, index = n.args[0], n.args[2]
        ri, rn = an.rows.get(index), an.rows.get(n)
        if not (isinstance(table, fx.Node) and isinstance(index, fx.Node) and index.op == "placeholder"
                and an.rows.get(table) is None and isinstance(ri, Rows) and ri.dim == 0 and not (ri.pre or ri.post)
                and isinstance(rn, Rows) and rn.dim == 0 and not (rn.pre or rn.post)):
            continue
        if _broadcasts(n, an):
            found[n] = Lookup(n, table, index)
    return found


def _broadcasts(root: fx.Node, an: Analysis) -> bool:
    """Every use an elementwise op: one stays per-entry (no full-rows operand) and is checked in turn, or meets a
    full-rows operand, whose rows the analysis has on the same axis (``analyze``: no op broadcasts rows against
    another dimension), so the broadcast gives stock's shape."""
    narrow, todo = {root}, [root]
    while todo:
        for u in todo.pop().users:
            if not _elementwise(u):
                return False
            full = any(m not in narrow and isinstance(an.rows.get(m), Rows) for m in u.all_input_nodes)
            if not full and u not in narrow:
                narrow.add(u)
                todo.append(u)
    return True


class IndexRuns:
    """The runs of equal values of a per-row index, read to the host once (one sync per block call)."""

    @staticmethod
    def of(index: torch.Tensor) -> IndexRuns | None:
        """None where the index has no values to read (the meta device: planning on shapes alone; no rows)."""
        return None if index.device.type == "meta" or index.numel() == 0 else IndexRuns(index)

    def __init__(self, index: torch.Tensor):
        flat = index.reshape(-1)
        change = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
        starts = torch.cat([change.new_zeros(1), change])
        self.starts, self.values = torch.stack([starts, flat[starts].to(starts.dtype)]).tolist()
        self.rows = flat.numel()

    def entry(self, a: int, b: int) -> int | None:
        """The one index rows [a, b) share, or None."""
        i = bisect.bisect_right(self.starts, a) - 1
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.rows
        return self.values[i] if b <= end else None


def entry_row(lookup: Lookup, table: torch.Tensor, runs: IndexRuns, a: int, b: int) -> torch.Tensor | None:
    """The table's row every row of [a, b) picks, as a one-row view (None: not one, or not a valid index, which
    index_select then reports as stock would)."""
    e = runs.entry(a, b)
    if e is None or not 0 <= e < table.shape[0]:
        return None
    return table.narrow(0, e, 1)
