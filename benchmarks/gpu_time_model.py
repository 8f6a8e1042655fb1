"""H200: the planner's time model against the clock (issue: time under a tight budget).

``sweep``: real-width blocks (bf16, random weights, the block's input copied, as a user applies it to one block) at
the lengths people run, each timed stock and under forced plans that span what the planner chooses between: row
chunks of every size, MLP slices, row pieces, head groups (L3), K/V in host memory (L4), and the planner's own plan
at 1.15x and 0.5x the floor (residual + K + V) above the inputs. Every variant runs on the same block and capture
(installed, timed, removed), median of ``repeats`` calls after one untimed call. The fit
(``streamplan.plan.time_model``) reads the rows back with each plan re-made on meta tensors.

``--variants store``: the K/V store's variants alone (chunks of 512-8192 rows, Q spans of 4-8 chunks), for its
constants' fit.

``held``: the issue's table: each block at each length under ``inputs + x * floor`` for the holds given, the
planner's plan, its predicted time ratio beside the measured one; each hold again with chunk replay off
(``/noreplay``). Forced chunks run with replay off, and again replayed (``c512/r``...).

    python benchmarks/gpu_time_model.py sweep --cases wan-14b-block,h3-block --tokens 32768,75600 --seconds 500
    python benchmarks/gpu_time_model.py held --cases wan-14b-block --tokens 32768,75600 --holds 1.15,0.5
    python benchmarks/gpu_time_model.py held --cases qwen3-moe-layer --tokens 131072 --holds 1.15 --donate
        # the block's input donated, as its model forward hands it (a fresh copy before each call, untimed)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import streamplan
from common import device_info, int_list, rel_diff, write_results
from streamplan.execute.donation import donate
from streamplan.tools.families import FAMILIES

BF16 = torch.bfloat16


def _floats(text: str) -> list[float]:
    """argparse type: comma-separated numbers."""
    try:
        return [float(h) for h in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _timed(fn, repeats: int, prepare=lambda: None) -> tuple[float, int, list[float]]:
    """(median seconds, peak bytes above what was allocated before, every time) over ``repeats`` calls; ``prepare``
    runs before each, untimed (a donated input's fresh copy)."""
    times, peak = [], 0
    for _ in range(repeats):
        arg = prepare()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn(arg)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        del out
    return statistics.median(times), peak, times


def variants(n: int, ffn: int, live: int, floor: int, holds: list[float]) -> list[tuple[str, dict]]:
    """Forced plans across the planner's choices, then its own plan under each hold."""
    out = [(f"c{c}", {"chunk_tokens": c}) for c in (512, 1024, 2048, 4096, 8192, 16384) if c <= n // 2]
    out += [("c4096/g2", {"chunk_tokens": 4096, "head_groups": 2}),
            ("c4096/g4", {"chunk_tokens": 4096, "head_groups": 4}),
            ("c4096/p4", {"chunk_tokens": 4096, "row_pieces": 4}),
            ("c8192/host", {"chunk_tokens": 8192, "kv": "host"})]
    if ffn:
        out.insert(len(out) - 4, ("c4096/s1024", {"chunk_tokens": 4096, "ffn_slice": 1024}))
        out.insert(len(out) - 4, ("c8192/s2048", {"chunk_tokens": 8192, "ffn_slice": 2048}))
    # chunks replayed as one recorded CUDA graph (``replay=True``) beside the same chunks eager (``replay=False``)
    out += [(f"c{c}/r", {"chunk_tokens": c, "replay": True}) for c in (512, 1024, 2048, 4096) if c <= n // 8]
    for label, kw in out:
        kw.setdefault("replay", False)
    # K/V in host memory read back in blocks of a pass's rows (a chunk's, up to 8,192; or a span's): the store's
    # copies, merges and block calls at block sizes from 512 to 8,192 rows and 1 to ~150 passes
    out += [(f"c{c}/host", {"chunk_tokens": c, "kv": "host", "replay": False})
            for c in (512, 1024, 2048, 4096) if c <= n // 8 and c * 64 >= n]
    out += [(f"c{c}/host/q{c * m}", {"chunk_tokens": c, "kv": "host", "q_span": c * m, "replay": False})
            for c, m in ((1024, 4), (2048, 4), (4096, 4), (2048, 8)) if c * m <= n // 2]
    # the same passes in shorter blocks: a block step's cost apart from a pass's
    out += [(f"c4096/host/b{b}", {"chunk_tokens": 4096, "kv": "host", "kv_block": b, "replay": False})
            for b in (1024, 2048)]
    # the planner's own plan (replay its choice), and the same hold with replay off
    for h in holds:
        out += [(f"hold{h}", {"budget": int(live + h * floor)}),
                (f"hold{h}/noreplay", {"budget": int(live + h * floor), "replay": False})]
    return out


def _ffn(block) -> int:
    widths = [m.out_features for name, m in block.named_modules()
              if isinstance(m, torch.nn.Linear) and any(k in name for k in ("ff", "mlp", "proj_mlp"))]
    return max(widths, default=0)


def run_case(name: str, n: int, repeats: int, holds: list[float], deadline: float, only_holds: bool,
             only: set[str] = frozenset(), donated: bool = False) -> list[dict]:
    fam = FAMILIES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = fam.build().to(BF16).eval()
    inputs = fam.inputs(n, torch.device("cuda"), BF16)
    live = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(inputs)
               if isinstance(t, torch.Tensor))
    floor = int(fam.floor_bytes_per_token(BF16) * n)
    base = {"case": name, "tokens": n, "floor_bytes": floor, "live_bytes": live, "input_donated": donated}
    rows = []
    # donated: the block's input handed over as its model forward hands it (``donate``: the block may write its
    # output over it), a fresh copy of it before each call, made outside the timing; stock runs on the same copies
    fresh = (lambda: inputs[0].clone()) if donated else (lambda: inputs[0])

    def call(first):
        with donate(*((first,) if donated else ())):
            return block(first, *inputs[1:])
    with torch.inference_mode():
        ref = _first(block(*inputs)).clone()
        stock_s, stock_peak, stock_times = _timed(call, repeats, fresh)
        rows.append({**base, "variant": "stock", "time_s": stock_s, "times_s": stock_times, "peak_bytes": stock_peak,
                     "time_ratio": 1.0})
        print(rows[-1], flush=True)
        chosen = variants(n, _ffn(block), live, floor, holds)
        if only_holds:
            chosen = [v for v in chosen if v[0].startswith("hold")]
        if only == {"store"}:
            chosen = [v for v in chosen if v[1].get("kv") == "host"]
        elif only:
            chosen = [v for v in chosen if v[0] in only]
        for label, kw in chosen:
            if time.monotonic() > deadline:
                rows.append({**base, "variant": label, "skipped": "out of time"})
                continue
            handle = streamplan.apply(block, capture="prefer", **kw)
            try:
                t0 = time.perf_counter()
                first = _first(call(fresh()))
                first_s = time.perf_counter() - t0
                diff = rel_diff(first, ref)
                del first
                secs, peak, times = _timed(call, repeats, fresh)
            except streamplan.BudgetError as exc:
                rows.append({**base, "variant": label, "kw": kw, "refused": str(exc)[:400],
                             "smallest_bytes": exc.smallest_bytes})
                handle.remove()
                print(rows[-1], flush=True)
                continue
            plans = handle.plans.get("", [])
            plan = plans[-1].to_dict() if plans else None
            notes = [n for n in handle.report().splitlines() if "replay" in n and "note" in n]
            handle.remove()
            budget = kw.get("budget")
            rows.append({**base, "variant": label, "kw": kw, "plan": plan, "first_call_s": first_s, "time_s": secs,
                         "times_s": times, "time_ratio": secs / stock_s, "peak_bytes": peak,
                         "peak_vs_floor": peak / floor, "rel_diff": diff,
                         "held": None if budget is None else peak + live <= budget, "replay_notes": notes})
            print({k: v for k, v in rows[-1].items() if k not in ("times_s", "plan")},
                  plan and {k: plan[k] for k in ("tier", "chunk", "ffn_slice", "head_groups", "kv", "q_span",
                                                 "replay", "predicted_peak", "predicted_time_ratio") if k in plan},
                  flush=True)
    del block, inputs, ref
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("sweep", "held"))
    p.add_argument("--cases", default="wan-14b-block,h3-block,flux2-single-block,ltx-video-block,llama3-8b-layer,"
                                      "hunyuan-double-block,flux2-double-block")
    p.add_argument("--tokens", type=int_list, default="32768,75600", help="rows, comma-separated")
    p.add_argument("--holds", type=_floats, default="1.15,0.5", help="budgets as multiples of the floor above the "
                   "inputs, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=520.0, help="stop starting variants after this long")
    p.add_argument("--tag", default="")
    p.add_argument("--variants", default="", help="sweep only these variants (e.g. c8192,c16384; "
                   "\"store\": every K/V store variant)")
    p.add_argument("--donate", action="store_true", help="hand each call a fresh copy of the block's input, donated "
                   "as a model forward hands its blocks theirs (the output may be written over it); default: the "
                   "input copied, as a user applies streamplan to one block")
    a = p.parse_args()
    deadline = time.monotonic() + a.seconds
    holds = a.holds
    payload = {**device_info(), "mode": a.mode, "repeats": a.repeats, "input_donated": a.donate, "rows": []}
    name = f"gpu_time_model_{a.mode}" + (f"_{a.tag}" if a.tag else "")
    for n in a.tokens:
        for case in a.cases.split(","):
            if time.monotonic() > deadline:
                payload["rows"].append({"case": case, "tokens": n, "skipped": "out of time"})
                continue
            payload["rows"] += run_case(case, n, a.repeats, holds, deadline, a.mode == "held",
                                        {v for v in a.variants.split(",") if v}, a.donate)
            write_results(name, payload)
    print(write_results(name, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
