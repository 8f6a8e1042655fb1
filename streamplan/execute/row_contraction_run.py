"""Phase KV's share of contractions over every row (``graph.row_contractions``): each contraction's inputs built
chunk by chunk into whole buffers, as an attention's K and V are, then the op run once on them; its result is held
for the call and read by every Q chunk as an input. Also the chunk put on whole lines where the rows are a grid
(``graph.grid_rows``)."""
from __future__ import annotations

from typing import Any

from .chunk_loop import attempt, chunk_bounds
from .whole_rows import whole_buffer, write_chunk_rows
from ..graph.contraction_phases import contraction_phases
from ..graph.export import Captured


def grid_chunk(cap: Captured, chunk: int) -> int:
    """``chunk`` rounded down to whole lines of the rows' grid (at least one line): a chunk's rows unflatten to it."""
    unit = getattr(cap, "row_unit", 1)
    return chunk if unit <= 1 else max(unit, chunk // unit * unit, cap.min_rows)


def build_contractions(run: Any, chunk: int) -> None:
    """Every contraction over the rows not yet computed in this call: its inputs whole, then its op once."""
    an = run.an
    for c, nodes in zip(an.contractions, contraction_phases(an, run.ph)):
        if c.node in run.base:
            continue
        bufs: dict = {}

        def work(a: int, b: int, c=c, nodes=nodes, bufs=bufs) -> None:
            env = run._run(nodes, run._inputs(a, b), a, set(c.inputs))
            for n in c.inputs:
                r = an.rows[n]
                if n not in bufs:
                    bufs[n] = whole_buffer(env[n], r, run.rows)
                write_chunk_rows(bufs[n], env[n], r, run.rows, a, b, a == 0)

        for a, b in chunk_bounds(run.rows, chunk, run.cap.min_rows):
            attempt(work, a, b, run._retries)
        env = {**run._inputs(0, run.rows), **bufs}
        run.base[c.node] = run._call(c.node, env)
        del env, bufs
