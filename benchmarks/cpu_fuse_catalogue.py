"""CPU: the fused path (``fuse=True``: Inductor's C++ backend stands in for Triton) over every catalogue case that
streams from its captured graph: the streamed output with its chains compiled against the same plan with them eager,
bit for bit, and what the report says of each chain. Why: the chains are found in any block's graph, and a default
that compiles them on CUDA should have met each graph shape the catalogue knows before a user's card does.

    python benchmarks/cpu_fuse_catalogue.py            # every case (tens of minutes: each new chain compiles)
    python benchmarks/cpu_fuse_catalogue.py wan,flux   # some
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings

import torch

import streamplan
from common import write_results
from streamplan.tools.catalogue import table


def _outputs(module, args, kwargs, **options):
    handle = streamplan.apply(module, chunk_tokens=table.CHUNK, capture="prefer", **options)
    try:
        with torch.no_grad():
            module(*args, **kwargs)
            out = module(*args, **kwargs)
        notes = [n for e in handle.installed.values() for n in e.runtime_notes]
        streamed = any(p.tier != "L0" for e in handle.installed.values() for p in e.plans.values())
        return table._floats(out), notes, streamed
    finally:
        handle.remove()


def main() -> int:
    warnings.filterwarnings("ignore")
    logging.getLogger("streamplan").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="?", default="", help="catalogue cases, comma-separated (default: every case)")
    only = {s for s in p.parse_args().cases.split(",") if s} or None
    rows = []
    for lib, _, cases in table._libraries():
        for name, case in cases.items():
            if only and name not in only:
                continue
            started = time.perf_counter()
            row = {"library": lib, "case": name}
            try:
                torch.manual_seed(0)
                module = case.build()
                args, kwargs = case.inputs(table.ROWS[lib], torch.device("cpu"), torch.float32)
                eager, _, streamed = _outputs(module, args, kwargs, fuse=False)
                fused, notes, _ = _outputs(module, args, kwargs, fuse=True)
                row.update(streamed=streamed, same=all(torch.equal(a, b) for a, b in zip(fused, eager)),
                           chains=[n for n in notes if "chain" in n])
            except Exception as exc:  # noqa: BLE001 -- a broken case is a row, not the end of the sweep
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(row, flush=True)
            write_results("cpu_fuse_catalogue", {"torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
