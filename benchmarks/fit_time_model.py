"""The time model's constants fitted to a GPU sweep (``gpu_time_model.py sweep``), on this machine's CPU.

Each measured row (stock, forced chunks, MLP slices, head groups) is re-made on meta tensors: the block's work
(``graph.work.block_work``) at its length, the plan's chunk, slices, groups and wave waste. The model's time is a sum
of parts each linear in one constant (1 / GEMM rate, 1 / attention rate, 1 / bandwidth, seconds per op, the head
groups' rerun share), so the constants are a non-negative least-squares fit of the measured seconds, each row weighed
by 1 / its time (relative error), with the GEMM efficiency's half-rate rows searched on a grid. Rows with K/V in a
store (L4) then fit the store's constants (``time_model.store_seconds``) on what each took beyond the fitted compute:
the share of its copies that shows, the merge's bandwidth, the cost of a block step and of each pass's head group
beyond one, with the share of the attention copies back hide under and the share that shows whatever it searched on
a grid. Row pieces are reported. Replayed rows (``c512/r``...)
fit ``replay_op`` and ``replay_setup`` once the rest is fitted. ``--fixed-rates``: a sweep of one block's chunk sizes
alone (too few rows for every constant) keeps the shipped rates and fits the host time per op (``op_s``) and the
replay's terms on top of them. Several files: their rows together (``held`` runs' plans too), each file's rows
against its own stock; files from another device than the shipped rates' are left out (``--device``).

Every measured plan is then re-made on meta tensors by the planner itself with the fitted rates: its predicted ratio
against the measured one, beside what the shipped rates predicted.

    python benchmarks/fit_time_model.py benchmarks/results/latest/gpu_time_model_sweep.json
    python benchmarks/fit_time_model.py benchmarks/results/latest/gpu_time_model_sweep{,_store}.json \
        benchmarks/results/latest/gpu_time_model_held_i32_table.json
    python benchmarks/fit_time_model.py --fixed-rates benchmarks/results/latest/gpu_time_model_sweep_replay.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
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
from streamplan.execute.kv_tiers import kv_options, span_problem
from streamplan.graph.work import block_work
from streamplan.plan import time_model
from streamplan.plan.planner import META_MULTIPROCESSORS, ATTENTION_RATE, Costs, Waves, store_traffic, wave_waste
from streamplan.plan.time_model import H200, Rates, Streamed, stock_seconds, store_copies, streamed_seconds
from streamplan.execute.donation import donate
from streamplan.tools.families import FAMILIES, on_meta

DEVICE = "NVIDIA H200"   # the device the shipped rates (``time_model.H200``) are for


def _work(case: str, n: int):
    """The block's work at ``n`` rows, its attention's waves, the bytes per row a replayed chunk stages, and its host
    store's memory model (``kv_options``, as the planner has it)."""
    module, inputs = on_meta(FAMILIES[case], n, torch.bfloat16)
    found, _ = streamable(module, inputs, {}, n)
    if isinstance(found, str):
        raise RuntimeError(f"{case}: {found}")
    qv = found.analysis.attentions[0].q.meta["val"]
    meta = torch.device("meta")
    (host,) = kv_options(found, n, meta, ("host",), spans=span_problem(found) is None)
    return (block_work(found, n), Waves(META_MULTIPROCESSORS, qv.shape[0] * qv.shape[1]),
            staged_row_bytes(found.analysis, found.captured.graph), host)


def _stored(row: dict) -> bool:
    p = row.get("plan")
    return bool(p) and p["kv"] == "host"


def _shape(row: dict, waves: Waves) -> Streamed | None:
    """What the time model reads of a row's plan, as the planner's ``time_ratio`` makes it: a store's passes
    attend a span's (or a chunk's) query rows, and its phase KV runs once whatever its head groups."""
    p = row.get("plan")
    if row["variant"] == "stock":
        return None
    n = row["tokens"]
    slices = row.get("slices", 1)
    g = p["head_groups"]
    q_rows = (p.get("q_span") or p["chunk"]) if _stored(row) else p["chunk"]
    waste = max(0.0, wave_waste(waves, q_rows, g) - wave_waste(waves, n))
    return Streamed(p["chunk"], slices or 1, 1 if _stored(row) else g, waste)


def _traffic(row: dict, work: tuple):
    """A store row's ``StoreTraffic`` as the planner prices it, the attention's seconds at the planner's rate."""
    w, _, _, host = work
    p = row["plan"]
    costs = Costs(w.attention_flops / ATTENTION_RATE["meta"], "meta")
    return store_traffic(host, row["tokens"], p.get("q_span") or p["chunk"], costs, p["kv_block"], p["head_groups"])


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
    p.add_argument("sweeps", nargs="+", help="gpu_time_model.py runs' JSON (sweep or held)")
    p.add_argument("--fixed-rates", action="store_true", help="keep the shipped H200 rates; fit op_s (and the "
                   "replay's terms) alone")
    p.add_argument("--store-only", action="store_true", help="keep the shipped compute rates; fit the K/V store's "
                   "constants alone (a store sweep, or one from another device whose compute matches)")
    p.add_argument("--device", default=DEVICE, help=f"the devices whose runs are fitted, comma-separated (default "
                   f"{DEVICE!r}, whose rates ship); others' files are left out")
    p.add_argument("--tag", default="", help="written as gpu_time_model_fit_<tag>.json")
    a = p.parse_args()
    rows = []
    for path in a.sweeps:
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError) as exc:
            p.error(f"cannot read the sweep {path!r}: {exc}")
        got = run.get("rows") if isinstance(run, dict) else None
        if not isinstance(got, list) or not any(r.get("variant") == "stock" for r in got):
            p.error(f"{path!r} is not a gpu_time_model.py run with stock rows")
        if run.get("device") not in a.device.split(","):
            print(f"left out: {path} (run on {run.get('device')!r}, not {a.device!r})")
            continue
        rows += [{**r, "source": path} for r in got if "time_s" in r]
    if not rows:
        p.error(f"no run on {a.device!r} among the files given")
    if a.fixed_rates and a.store_only:
        p.error("--fixed-rates and --store-only are two different fits: give one")
    return fit(rows, a.sweeps, a.fixed_rates, a.tag, a.store_only)


def _fit_all(fit_rows: list[dict], works: dict) -> tuple:
    """Every constant, the GEMM half-rate rows searched on a grid: (rms relative error, half, coefficients, the
    parts matrix, measured seconds)."""
    best = None
    for half in (0, 50, 100, 130, 200, 300, 400, 600):
        a, t = _matrix(fit_rows, works, half)
        coef, _ = nnls(a / t[:, None], np.ones(len(t)))
        err = a @ coef / t - 1
        score = float(np.sqrt(np.mean(err ** 2)))
        if best is None or score < best[0]:
            best = (score, half, coef, a, t)
    return best


def _matrix(fit_rows: list[dict], works: dict, half: float) -> tuple[np.ndarray, np.ndarray]:
    """The rows' parts (``_parts``) and their measured seconds."""
    a = np.array([_parts(works[(r["case"], r["tokens"])][0], _shape(r, works[(r["case"], r["tokens"])][1]), half)
                  for r in fit_rows])
    return a, np.array([r["time_s"] for r in fit_rows])


def _shipped_coef() -> np.ndarray:
    """The shipped rates as ``_parts``' coefficients."""
    return np.array([1 / H200.gemm, 1 / H200.attention, 1 / H200.bandwidth, H200.op_s, H200.group_rerun])


def _shipped(fit_rows: list[dict], works: dict) -> tuple:
    """The shipped compute rates as they are (``--store-only``), scored on the rows without a store."""
    half = H200.gemm_half_rows
    a, t = _matrix(fit_rows, works, half)
    coef = _shipped_coef()
    err = a @ coef / t - 1
    return float(np.sqrt(np.mean(err ** 2))), half, coef, a, t


def _fit_op_s(fit_rows: list[dict], works: dict) -> tuple:
    """``op_s`` alone, the shipped rates kept for the rest: what each row took beyond their parts."""
    half = H200.gemm_half_rows
    a, t = _matrix(fit_rows, works, half)
    coef = _shipped_coef()
    coef[3] = 0.0
    (op_s,), _ = nnls((a[:, 3] / t)[:, None], (t - a @ coef) / t)
    coef[3] = op_s
    err = a @ coef / t - 1
    return float(np.sqrt(np.mean(err ** 2))), half, coef, a, t


def _key(r: dict) -> tuple:
    return r["source"], r["case"], r["tokens"]


def fit(rows: list[dict], sources: list[str], fixed_rates: bool = False, tag: str = "", store_only: bool = False
        ) -> int:
    works = {}
    for r in rows:
        key = (r["case"], r["tokens"])
        if key not in works:
            works[key] = _work(*key)
    fit_rows, stored, other, replayed = [], [], [], []
    for r in rows:
        p = r.get("plan")
        if p and p["ffn_slice"] and p["ffn_slice"] < _ffn_of(r["case"]):   # as the planner prices it, any tier
            r = {**r, "slices": -(-_ffn_of(r["case"]) // p["ffn_slice"])}
        if p and p.get("replay"):   # fitted apart, once the rest is (``_fit_replay``)
            replayed.append(r)
        elif p and (r.get("kw", {}).get("row_pieces") or p.get("row_pieces", 1) > 1 or p["kv"] not in ("device",
                                                                                                       "host")):
            other.append(r)
        elif _stored(r):            # fitted apart, on what the compute's fit leaves (``_fit_store``)
            stored.append(r)
        else:
            fit_rows.append(r)
    score, half, coef, a, t = (_shipped if store_only else _fit_op_s if fixed_rates else _fit_all)(fit_rows, works)
    inv = lambda c: float(1 / c) if c else float("inf")  # noqa: E731
    rates = replace(H200, gemm=inv(coef[0]), gemm_half_rows=float(half), attention=inv(coef[1]),
                    bandwidth=inv(coef[2]), op_s=float(coef[3]), group_rerun=float(coef[4]))
    if replayed:
        rates = _fit_replay(replayed, works, rates, coef, half)
    store_fit = {}
    if stored:
        rates, store_fit = _fit_store(stored, works, rates, coef, half)
    print(f"fit over {len(t)} rows: rms relative error {score:.3f}; {rates}")
    # ratio errors: predicted (plan / stock of the same case) against measured
    out = []
    stock = {_key(r): r["time_s"] for r in rows if r["variant"] == "stock"}
    pred = dict(zip([id(r) for r in fit_rows], a @ coef))
    pstock = {_key(r): pred[id(r)] for r in fit_rows if r["variant"] == "stock"}
    for r in fit_rows:
        if _key(r) not in pstock:
            continue
        measured = r["time_s"] / stock[_key(r)]
        predicted = pred[id(r)] / pstock[_key(r)]
        out.append({"case": r["case"], "tokens": r["tokens"], "variant": r["variant"], "measured_ratio": measured,
                    "predicted_ratio": predicted, "error": predicted / measured - 1})
        print(f"{r['case']:22s} {r['tokens']:6d} {r['variant']:12s} measured {measured:6.3f} predicted "
              f"{predicted:6.3f} ({predicted / measured - 1:+.1%})")
    errs = np.array([o["error"] for o in out])
    print(f"model-part ratio error: rms {np.sqrt(np.mean(errs ** 2)):.3f}, max {np.max(np.abs(errs)):.3f}")
    out = [_planned(r, stock, rates) for r in rows if r["variant"] != "stock"]
    for o in out:
        print(f"{o['case']:22s} {o['tokens']:6d} {o['variant']:18s} {o['plan']:60s} measured {o['measured_ratio']:6.3f}"
              f" fitted predicts {o['predicted_ratio']:6.3f} ({o['error']:+.1%}), shipped {o['shipped_ratio']:6.3f} "
              f"({o['shipped_error']:+.1%})")
    summary = {}
    for label, key in (("fitted", "error"), ("shipped", "shipped_error")):
        errs = np.array([o[key] for o in out])
        summary[label] = {"ratio_error_rms": float(np.sqrt(np.mean(errs ** 2))),
                          "ratio_error_max": float(np.max(np.abs(errs))),
                          "within_20pct": float(np.mean(np.abs(errs) <= 0.2))}
        print(f"{label} rates, ratio error: rms {summary[label]['ratio_error_rms']:.3f}, max "
              f"{summary[label]['ratio_error_max']:.3f}, within 20%: {summary[label]['within_20pct']:.0%}")
    name = "gpu_time_model_fit" + ("_fixed_rates" if fixed_rates else "_store" if store_only else "") \
        + (f"_{tag}" if tag else "")
    write_results(name, {"sources": sources, "fixed_rates": fixed_rates, "store_only": store_only,
                         "rows_fitted": len(t),
                         "rms_relative_error": score, "rates_fitted": rates.__dict__, "rates_used": H200.__dict__,
                         "store_fit": store_fit, **summary["fitted"], "shipped": summary["shipped"],
                         "ratios": out,
                         "not_fitted": [{k: r[k] for k in ("case", "tokens", "variant", "time_s")} for r in other]})
    return 0


def _fit_store(stored: list[dict], works: dict, rates: Rates, coef: np.ndarray, half: float) -> tuple[Rates, dict]:
    """The store's constants from its rows, the compute's as fitted: what each row took beyond its compute's parts
    is ``store_share`` x its copies + merge bytes / ``merge_bandwidth`` + block steps x ``block_step_s`` + passes x
    extra head groups x ``group_step_s``, a non-negative least-squares fit in relative error, with ``store_hidden``
    and ``store_unhidden`` searched on a grid."""
    best = None
    for hidden in (0.0, 0.25, 0.5, 0.75, 1.0):
        for unhidden in (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
            trial = replace(rates, store_hidden=hidden, store_unhidden=unhidden)
            a, y, t = [], [], []
            for r in stored:
                work = works[(r["case"], r["tokens"])]
                tr = _traffic(r, work)
                a.append([store_copies(tr, trial), tr.merge_bytes, tr.calls, tr.passes * (tr.groups - 1)])
                y.append(r["time_s"] - _parts(work[0], _shape(r, work[1]), half) @ coef)
                t.append(r["time_s"])
            a, y, t = np.array(a), np.array(y), np.array(t)
            c, _ = nnls(a / t[:, None], y / t)
            err = (a @ c - y) / t
            score = float(np.sqrt(np.mean(err ** 2)))
            if best is None or score < best[0]:
                best = (score, hidden, unhidden, c)
    score, hidden, unhidden, (share, merge, step, group_step) = best
    fitted = replace(rates, store_hidden=hidden, store_unhidden=unhidden, store_share=float(share),
                     merge_bandwidth=float(1 / merge) if merge else float("inf"), block_step_s=float(step),
                     group_step_s=float(group_step))
    print(f"store fit over {len(stored)} rows: rms relative error {score:.3f}; hidden {hidden}, unhidden "
          f"{unhidden}, share {share:.3f}, merge {fitted.merge_bandwidth:.3g} B/s, block step {step * 1e6:.0f} us, "
          f"each pass's extra head group {group_step * 1e6:.0f} us")
    return fitted, {"rows": len(stored), "rms_relative_error": score}


def _fit_replay(replayed: list[dict], works: dict, rates: Rates, coef: np.ndarray, half: float) -> Rates:
    """``replay_op`` and ``replay_setup`` from the replayed rows, the other constants as fitted: what a replayed row
    took beyond the model's work without ops and its staging's copies is ``op_s`` times a chunk's ops times
    (2 + setup + (chunks - 2) * replay_op), a non-negative least-squares fit in relative error."""
    a, y, t = [], [], []
    for r in replayed:
        w, waves, staged_row, _ = works[(r["case"], r["tokens"])]
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


@contextlib.contextmanager
def _rates_on_meta(rates: Rates):
    """Plans on meta tensors priced with ``rates`` while inside."""
    shipped = time_model.RATES["meta"]
    time_model.RATES["meta"] = rates
    try:
        yield
    finally:
        time_model.RATES["meta"] = shipped


def _planned(row: dict, stock: dict, rates: Rates) -> dict:
    """The measured plan re-made on meta tensors by the planner itself (its shape forced), and the predicted time
    ratio it carries with the fitted rates and with the shipped ones: what `report()` would have said before the
    run."""
    p, n = row["plan"], row["tokens"]
    kw = {"chunk_tokens": p["chunk"], "kv": p["kv"], "budget": None}
    if p["ffn_slice"] and p["tier"] != "L1":
        kw["ffn_slice"] = p["ffn_slice"]
    if p["head_groups"] > 1:
        kw["head_groups"] = p["head_groups"]
    if p["kv"] != "device" and p["q_span"]:
        kw["q_span"] = p["q_span"]
    if p["kv"] != "device":
        kw["kv_block"] = p["kv_block"]
    pieces = row.get("kw", {}).get("row_pieces") or p.get("row_pieces", 1)
    if pieces > 1:
        kw["row_pieces"] = pieces
    kw["replay"] = bool(p.get("replay"))
    ratios = []
    for priced in (rates, H200):
        module, inputs = on_meta(FAMILIES[row["case"]], n, torch.bfloat16)
        with _rates_on_meta(priced):
            handle = streamplan.apply(module, capture="prefer", **kw)
            with torch.inference_mode(), donate(*(inputs[:1] if row.get("input_donated") else ())):
                module(*inputs)
        plan = handle.plans[""][-1]
        handle.remove()
        ratios.append(plan.predicted_time_ratio)
    measured = row["time_s"] / stock[_key(row)]
    return {"case": row["case"], "tokens": n, "variant": row["variant"], "plan": plan.describe(figures=False),
            "measured_ratio": measured, "predicted_ratio": ratios[0], "error": ratios[0] / measured - 1,
            "shipped_ratio": ratios[1], "shipped_error": ratios[1] / measured - 1}


@functools.lru_cache(maxsize=None)
def _ffn_of(case: str) -> int:
    module, _ = on_meta(FAMILIES[case], 1024, torch.bfloat16)
    return max(m.out_features for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and any(k in name for k in ("ff", "mlp")))


if __name__ == "__main__":
    sys.exit(main())
