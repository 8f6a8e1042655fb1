"""The time model's constants fitted to a GPU sweep (``gpu_time_model.py sweep``), on this machine's CPU.

Each measured row (stock, forced chunks, MLP slices, head groups) is re-made on meta tensors: the block's work
(``graph.work.block_work``) at its length, the plan's chunk, slices, groups and wave waste. The model's time is a sum
of parts each linear in one constant (1 / GEMM rate, 1 / attention rate, 1 / bandwidth, seconds per op, the head
groups' rerun share), so the constants are a non-negative least-squares fit of the measured seconds, each row weighed
by 1 / its time (relative error), with the GEMM efficiency's half-rate rows searched on a grid. Rows with K/V in a
store (L4) are priced with the planner's own store model on top and reported, not fitted; row pieces are reported.
Replayed rows (``c512/r``...) fit ``replay_op`` and ``replay_setup`` once the rest is fitted. ``--fixed-rates``: a
sweep of one block's chunk sizes alone (too few rows for every constant) keeps the shipped rates and fits the host
time per op (``op_s``) and the replay's terms on top of them.

    python benchmarks/fit_time_model.py benchmarks/results/latest/gpu_time_model_sweep.json
    python benchmarks/fit_time_model.py --fixed-rates benchmarks/results/latest/gpu_time_model_sweep_replay.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np
import torch
from scipy.optimize import nnls

import streamplan

from common import write_results
from streamplan.graph import streamable
from streamplan.execute.chunk_replay import staged_row_bytes
from streamplan.graph.work import block_work
from streamplan.plan.planner import META_MULTIPROCESSORS, Waves, wave_waste
from streamplan.plan.time_model import H200, Rates, Streamed, stock_seconds, streamed_seconds
from streamplan.execute.donation import donate
from streamplan.tools.families import FAMILIES, on_meta


def _work(case: str, n: int):
    """The block's work at ``n`` rows, its attention's waves, and the bytes per row a replayed chunk stages."""
    module, inputs = on_meta(FAMILIES[case], n, torch.bfloat16)
    found, _ = streamable(module, inputs, {}, n)
    if isinstance(found, str):
        raise RuntimeError(f"{case}: {found}")
    qv = found.analysis.attentions[0].q.meta["val"]
    return (block_work(found, n), Waves(META_MULTIPROCESSORS, qv.shape[0] * qv.shape[1]),
            staged_row_bytes(found.analysis, found.captured.graph))


def _shape(row: dict, waves: Waves) -> Streamed | None:
    p = row.get("plan")
    if row["variant"] == "stock":
        return None
    n = row["tokens"]
    slices = row.get("slices", 1)
    g = p["head_groups"]
    waste = max(0.0, wave_waste(waves, p["chunk"], g) - wave_waste(waves, n))
    return Streamed(p["chunk"], slices or 1, g, waste)


def _parts(w, s: Streamed | None, half: float) -> np.ndarray:
    """The model's seconds split by constant: each column is the part priced by one of (1/gemm, 1/attention,
    1/bandwidth, op_s, group_rerun)."""
    unit = Rates(gemm=1.0, gemm_half_rows=half, attention=1e30, bandwidth=1e30, op_s=0.0, group_rerun=0.0)
    n = w.rows
    s0 = s or Streamed(n)
    cols = []
    gemm = streamed_seconds(w, unit, s0) if s else stock_seconds(w, unit)
    cols.append(gemm)
    att = (w.attention_flops * (1 + s0.wave_waste) + w.attention_flops_row * n)
    cols.append(att)
    mem = (w.bytes_row + (w.rerun_bytes_row if s else 0.0)) * n
    cols.append(mem)
    k = -(-n // max(1, min(s0.chunk, n)))
    ops = (k * (w.ops_kv * s0.groups + w.ops_q + (s0.slices - 1) * w.ops_mlp)) if s else (w.ops_kv + w.ops_q)
    cols.append(ops)
    c = max(1, min(s0.chunk, n))
    groups = (s0.groups - 1) * (w.kv_flops_row * n / (c / (c + half)) / H200.gemm + w.kv_bytes_row * n / H200.bandwidth)
    cols.append(groups)
    return np.array(cols)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="a gpu_time_model.py sweep's JSON")
    p.add_argument("--fixed-rates", action="store_true", help="keep the shipped H200 rates; fit op_s (and the "
                   "replay's terms) alone")
    a = p.parse_args()
    try:
        with open(a.sweep) as f:
            rows = json.load(f).get("rows")
    except (OSError, ValueError) as exc:
        p.error(f"cannot read the sweep {a.sweep!r}: {exc}")
    if not isinstance(rows, list) or not any(r.get("variant") == "stock" for r in rows):
        p.error(f"{a.sweep!r} is not a gpu_time_model.py sweep with stock rows")
    return fit(a.sweep, a.fixed_rates)


def _fit_all(fit_rows: list[dict], works: dict) -> tuple:
    """Every constant, the GEMM half-rate rows searched on a grid: (rms relative error, half, coefficients, the
    parts matrix, measured seconds)."""
    best = None
    for half in (0, 50, 100, 130, 200, 300, 400, 600):
        a = np.array([_parts(works[(r["case"], r["tokens"])][0], _shape(r, works[(r["case"], r["tokens"])][1]), half)
                      for r in fit_rows])
        t = np.array([r["time_s"] for r in fit_rows])
        coef, _ = nnls(a / t[:, None], np.ones(len(t)))
        err = a @ coef / t - 1
        score = float(np.sqrt(np.mean(err ** 2)))
        if best is None or score < best[0]:
            best = (score, half, coef, a, t)
    return best


def _fit_op_s(fit_rows: list[dict], works: dict) -> tuple:
    """``op_s`` alone, the shipped rates kept for the rest: what each row took beyond their parts."""
    half = H200.gemm_half_rows
    a = np.array([_parts(works[(r["case"], r["tokens"])][0], _shape(r, works[(r["case"], r["tokens"])][1]), half)
                  for r in fit_rows])
    t = np.array([r["time_s"] for r in fit_rows])
    coef = np.array([1 / H200.gemm, 1 / H200.attention, 1 / H200.bandwidth, 0.0, H200.group_rerun])
    (op_s,), _ = nnls((a[:, 3] / t)[:, None], (t - a @ coef) / t)
    coef[3] = op_s
    err = a @ coef / t - 1
    return float(np.sqrt(np.mean(err ** 2))), half, coef, a, t


def fit(path: str, fixed_rates: bool = False) -> int:
    sweep = json.load(open(path))
    rows = [r for r in sweep["rows"] if "time_s" in r]
    works = {}
    for r in rows:
        key = (r["case"], r["tokens"])
        if key not in works:
            works[key] = _work(*key)
    fit_rows, other, replayed = [], [], []
    for r in rows:
        p = r.get("plan")
        if p and p.get("replay"):   # fitted apart, once the rest is (``_fit_replay``)
            replayed.append(r)
            continue
        if p and (p["kv"] != "device" or r.get("kw", {}).get("row_pieces")):
            other.append(r)
            continue
        if p and p["tier"] == "L2":
            r = {**r, "slices": -(-_ffn_of(r["case"]) // p["ffn_slice"])}
        fit_rows.append(r)
    score, half, coef, a, t = (_fit_op_s if fixed_rates else _fit_all)(fit_rows, works)
    inv = lambda c: float(1 / c) if c else float("inf")  # noqa: E731
    rates = replace(H200, gemm=inv(coef[0]), gemm_half_rows=float(half), attention=inv(coef[1]),
                    bandwidth=inv(coef[2]), op_s=float(coef[3]), group_rerun=float(coef[4]))
    if replayed:
        rates = _fit_replay(replayed, works, rates, coef, half)
    print(f"fit over {len(t)} rows: rms relative error {score:.3f}; {rates}")
    # ratio errors: predicted (plan / stock of the same case) against measured
    out = []
    stock = {(r["case"], r["tokens"]): r["time_s"] for r in rows if r["variant"] == "stock"}
    pred = dict(zip([id(r) for r in fit_rows], a @ coef))
    pstock = {(r["case"], r["tokens"]): pred[id(r)] for r in fit_rows if r["variant"] == "stock"}
    for r in fit_rows:
        key = (r["case"], r["tokens"])
        measured = r["time_s"] / stock[key]
        predicted = pred[id(r)] / pstock[key]
        out.append({"case": r["case"], "tokens": r["tokens"], "variant": r["variant"], "measured_ratio": measured,
                    "predicted_ratio": predicted, "error": predicted / measured - 1})
        print(f"{r['case']:22s} {r['tokens']:6d} {r['variant']:12s} measured {measured:6.3f} predicted "
              f"{predicted:6.3f} ({predicted / measured - 1:+.1%})")
    errs = np.array([o["error"] for o in out])
    print(f"model-part ratio error: rms {np.sqrt(np.mean(errs ** 2)):.3f}, max {np.max(np.abs(errs)):.3f}")
    out = [_planned(r, stock) for r in rows if r["variant"] != "stock"]
    for o in out:
        print(f"{o['case']:22s} {o['tokens']:6d} {o['variant']:12s} {o['plan']:60s} "
              f"measured {o['measured_ratio']:6.3f} planner predicts {o['predicted_ratio']:6.3f} ({o['error']:+.1%})")
    errs = np.array([o["error"] for o in out])
    print(f"ratio error: rms {np.sqrt(np.mean(errs ** 2)):.3f}, max {np.max(np.abs(errs)):.3f}, "
          f"within 20%: {np.mean(np.abs(errs) <= 0.2):.0%}")
    write_results("gpu_time_model_fit" + ("_fixed_rates" if fixed_rates else ""),
                  {"source": path, "fixed_rates": fixed_rates, "rows_fitted": len(t), "rms_relative_error": score,
                   "rates_fitted": rates.__dict__, "rates_used": H200.__dict__,
                   "ratio_error_rms": float(np.sqrt(np.mean(errs ** 2))),
                   "ratio_error_max": float(np.max(np.abs(errs))),
                   "within_20pct": float(np.mean(np.abs(errs) <= 0.2)), "ratios": out,
                   "not_fitted": [{k: r[k] for k in ("case", "tokens", "variant", "time_s")} for r in other]})
    return 0


def _fit_replay(replayed: list[dict], works: dict, rates: Rates, coef: np.ndarray, half: float) -> Rates:
    """``replay_op`` and ``replay_setup`` from the replayed rows, the other constants as fitted: what a replayed row
    took beyond the model's work without ops and its staging's copies is ``op_s`` times a chunk's ops times
    (2 + setup + (chunks - 2) * replay_op), a non-negative least-squares fit in relative error."""
    a, y, t = [], [], []
    for r in replayed:
        w, waves, staged_row = works[(r["case"], r["tokens"])]
        s = _shape(r, waves)
        parts = _parts(w, s, half)
        k = -(-w.rows // max(1, min(s.chunk, w.rows)))
        per_chunk = parts[3] / k * coef[3]   # a chunk's ops' seconds at op_s
        rest = parts @ coef - parts[3] * coef[3] + 2 * w.rows * staged_row / rates.bandwidth
        a.append([per_chunk, (k - 2) * per_chunk])
        y.append(r["time_s"] - rest - 2 * per_chunk)
        t.append(r["time_s"])
    a, y, t = np.array(a), np.array(y), np.array(t)
    (setup, op), _ = nnls(a / t[:, None], y / t)
    err = (a @ np.array([setup, op]) - y) / t
    print(f"replay fit over {len(t)} rows: replay_setup {setup:.2f} chunks, replay_op {op:.3f} of op_s; "
          f"rms relative error {np.sqrt(np.mean(err ** 2)):.3f}")
    return replace(rates, replay_setup=float(setup), replay_op=float(op))


def _planned(row: dict, stock: dict) -> dict:
    """The measured plan re-made on meta tensors by the planner itself (its shape forced), and the predicted time
    ratio it carries: what `report()` would have said before the run."""
    p, n = row["plan"], row["tokens"]
    kw = {"chunk_tokens": p["chunk"], "kv": p["kv"], "budget": None}
    if p["ffn_slice"] and p["tier"] != "L1":
        kw["ffn_slice"] = p["ffn_slice"]
    if p["head_groups"] > 1:
        kw["head_groups"] = p["head_groups"]
    if p["kv"] != "device" and p["q_span"]:
        kw["q_span"] = p["q_span"]
    if row.get("kw", {}).get("row_pieces"):
        kw["row_pieces"] = row["kw"]["row_pieces"]
    kw["replay"] = bool(p.get("replay"))
    module, inputs = on_meta(FAMILIES[row["case"]], n, torch.bfloat16)
    handle = streamplan.apply(module, capture="prefer", **kw)
    with torch.inference_mode(), donate(*(inputs[:1] if row.get("input_donated") else ())):
        module(*inputs)
    plan = handle.plans[""][-1]
    handle.remove()
    measured = row["time_s"] / stock[(row["case"], n)]
    return {"case": row["case"], "tokens": n, "variant": row["variant"], "plan": plan.describe(figures=False),
            "measured_ratio": measured, "predicted_ratio": plan.predicted_time_ratio,
            "error": plan.predicted_time_ratio / measured - 1}


def _ffn_of(case: str) -> int:
    module, _ = on_meta(FAMILIES[case], 1024, torch.bfloat16)
    return max(m.out_features for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and any(k in name for k in ("ff", "mlp")))


if __name__ == "__main__":
    sys.exit(main())
