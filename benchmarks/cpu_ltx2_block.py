"""LTX-2's block at real width on the CPU (fp32, random weights): the project's meter (``streamplan.measure_peak``)
against the memory model's prediction, in fixed row chunks, with its per-row tables made piece by piece (the default)
and, for comparison, captured with them whole. Where the GPU runs of RESULTS.md found their misses (the constants of
the audio side kept for the call; the tables whole), this checks the model on the same block without a GPU.

    python benchmarks/cpu_ltx2_block.py                  # 6,000 rows, 2,048-row chunks: ~4 min on 2 CPU cores
    python benchmarks/cpu_ltx2_block.py --rows 3000 --chunk 1024
JSON to $OUT (else results/latest/cpu_ltx2_block.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import streamplan
import streamplan.graph as graph
from streamplan.tools.families import FAMILIES

MIB = 2 ** 20


def streamed(block, args: tuple, kwargs: dict, chunk: int) -> dict:
    handle = streamplan.apply(block, capture="prefer", budget=None, chunk_tokens=chunk)
    try:
        start = time.perf_counter()
        block(*args, **kwargs)   # captures and plans
        first = time.perf_counter() - start
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
        (plan,) = handle.plans[""]
        return {"out": out, "peak_bytes": peak, "predicted_peak": plan.predicted_peak, "plan": plan.describe(
            figures=False), "first_call_s": first}
    finally:
        handle.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=6000, help="video rows (not 4,096 or 8,192: the capture would take the "
                                                          "row count for the width's)")
    p.add_argument("--chunk", type=int, default=2048)
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    fam = FAMILIES["ltx2-block"]
    torch.manual_seed(0)
    block = fam.build().eval()
    args = fam.inputs(a.rows, torch.device("cpu"), torch.float32)
    kwargs = dict(fam.call_kwargs or {})
    print(f"LTX-2 block, {a.rows} rows, fp32, chunks of {a.chunk}", flush=True)
    ref, stock = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
    print(f"stock: {stock / MIB:.1f} MiB", flush=True)
    rows = []
    for label, pieces in (("tables piece by piece", True), ("tables whole", False)):
        graph._CACHE.clear()
        saved = graph.split_read_in_pieces
        if not pieces:
            graph.split_read_in_pieces = lambda g: 0
        try:
            got = streamed(block, args, kwargs, a.chunk)
        finally:
            graph.split_read_in_pieces = saved
            graph._CACHE.clear()
        out = got.pop("out")
        diff = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(out, ref))
        row = {"variant": label, **got, "measured_over_predicted": got["peak_bytes"] / got["predicted_peak"],
               "rel_diff": diff}
        rows.append(row)
        print(f"{label}: measured {got['peak_bytes'] / MIB:.2f} MiB, predicted {got['predicted_peak'] / MIB:.2f} MiB "
              f"({row['measured_over_predicted']:.4f}), {got['plan']}, relative difference {diff:.1e}", flush=True)
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": a.rows, "chunk": a.chunk, "stock_peak_bytes": stock,
              "variants": rows}
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest")
    path = os.path.join(out_dir, "cpu_ltx2_block.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(path)


if __name__ == "__main__":
    sys.exit(main())
