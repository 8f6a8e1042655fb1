"""Below the floor (issue 14) on the H200: MiniMax-H3 and Wan2.1-14B blocks at real width, bf16, from their captured
graphs, with K/V kept whole on the device (the exact tier), host-staged (L4, exact; whole heads and in head groups),
int8 and fp8 (L5, approximate), and the planner under a budget that both L3 and L4 reach (it should take the faster;
both are also run forced).

Per mode: peak KB/token above weights and inputs (CUDA allocator), against the floor (residual + K + V); time against
stock in the same run; output difference against stock (rel, max abs) and against the exact device tier, beside
stock's own kernel-to-kernel differences (flash and mem-efficient against SDPA's default, cuDNN); non-finite outputs
counted; the plan (tier, chunk, K/V block, head groups, host traffic) and the report's notes (an approximate store's
first-call error). JSON to $OUT (or benchmarks/results/latest/) as gpu_kv_<tokens>.json.

The self-check (first, H3 width) looks for the non-finite rows the first H200 run had (33,792-row Q chunks against
512-row K/V blocks): (a) the store and merge alone at that geometry and others, Q chunk by Q chunk against the exact
tier's own call on the same Q/K/V, with other work between chunks; (b) the whole block under L4 at several chunks and
head groups against the exact tier's output. Each prints the first non-finite position, if any.

    python benchmarks/gpu_kv.py 217088                 # self-check, then both blocks, every mode (~6 min)
    python benchmarks/gpu_kv.py 217088 h3-block        # one block (no self-check)
    python benchmarks/gpu_kv.py selfcheck 217088       # the self-check alone
    python benchmarks/gpu_kv.py smoke                  # 8192 tokens on the GPU, every mode
    python benchmarks/gpu_kv.py dry                    # CPU, tiny widths: the same code path, no GPU needed
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from typing import Callable

import torch
from torch.utils import _pytree as pytree

import streamplan
from common import device_info, int_or, name_list, script_parser, write_results
from streamplan.verify import compare_outputs

BF16 = torch.bfloat16
SEED_KVI8R_KB_PER_TOKEN = 33.0   # the seed's rotated-int8 K/V store at 217k tokens (its figure, whole model, with trim)


def _gen(device):
    return torch.Generator(device=device).manual_seed(1)


def h3_block(n: int, device: str, width: dict):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    d, heads, hd, ffn, t = width["d"], width["heads"], width["hd"], width["ffn"], width["temb"]
    block = MiniMaxH3TransformerBlock(d, heads, hd, ffn, t, 1e-5, 1e-5)
    pos = torch.randn(n, hd * 3 // 4, device=device)
    dtype = width["dtype"]

    def inputs():
        g = _gen(device)
        return (torch.randn(1, n, d, device=device, dtype=dtype, generator=g),
                torch.randn(2, t, device=device, generator=g),
                torch.randint(0, 6, (n,), device=device, generator=g), (pos.cos(), pos.sin()))
    floor = n * (d + 2 * heads * hd) * torch.empty((), dtype=dtype).element_size()
    return f"diffusers MiniMaxH3TransformerBlock ({d}, {heads}x{hd}, SwiGLU {ffn})", block, inputs, floor


def wan_block(n: int, device: str, width: dict):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    d, heads, ffn = width["d"], width["heads"], width["ffn"]
    block = WanTransformerBlock(d, ffn, heads, cross_attn_norm=True)
    pos = torch.randn(1, n, 1, d // heads, device=device)
    dtype = width["dtype"]

    def inputs():
        g = _gen(device)
        return (torch.randn(1, n, d, device=device, dtype=dtype, generator=g),
                torch.randn(1, 512, d, device=device, dtype=dtype, generator=g),
                torch.randn(1, 6, d, device=device, generator=g), (pos.cos(), pos.sin()))
    return f"diffusers WanTransformerBlock ({d}, {heads} heads, ffn {ffn})", block, inputs, \
        n * d * 3 * torch.empty((), dtype=dtype).element_size()


BLOCKS: dict[str, tuple[Callable, dict, dict]] = {   # real width, and the dry run's tiny one
    "h3-block": (h3_block, dict(d=5376, heads=56, hd=128, ffn=14336, temb=2688, dtype=BF16),
                 dict(d=64, heads=4, hd=16, ffn=256, temb=32, dtype=torch.float32)),
    "wan-14b-block": (wan_block, dict(d=5120, heads=40, ffn=13824, dtype=BF16),
                      dict(d=64, heads=4, ffn=256, dtype=torch.float32)),
}


def _peak(fn, device: str):
    return streamplan.measure_peak(fn, device=device)


def _time(fn, device: str, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _diff(out, ref) -> dict[str, float]:
    d = compare_outputs(out, ref)
    return {"rel": max(v["rel"] for v in d.values()), "max_abs": max(v["max_abs"] for v in d.values()),
            "nan_mismatch": sum(v.get("nan_mismatch", 0) for v in d.values())}


def _nonfinite(out) -> dict:
    """How many values of the output are not finite, and where the first is (flat index, and row, feature of a
    [B, rows, features] output)."""
    t = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)][0]
    bad = ~torch.isfinite(t)
    count = int(bad.sum().item())
    if not count:
        return {"nonfinite": 0}
    first = int(bad.flatten().nonzero()[0].item())
    where = {"first_flat": first}
    if t.dim() == 3:
        where.update(row=first // t.shape[-1] % t.shape[1], feature=first % t.shape[-1])
    return {"nonfinite": count, **where}


def _live(args) -> int:
    return sum(a.numel() * a.element_size() for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))


# a forced L4 plan in head groups that the planner's model puts under 0.5x the floor at 217,088 tokens (on meta):
# (Q chunk, head groups, MLP slice); H3 0.47x, Wan 0.45x
GROUPED_L4 = {"h3-block": (24576, 8, 2048), "wan-14b-block": (8192, 10, None)}
# forced Q spans (Q chunk, span, head groups) at 217,088 tokens: the Wan plan the planner made under 0.5x the floor
# before it priced the copies back (measured 2026-12-01: 0.42x at 1.113x), and one span of H3's 8-group chunk
SPANNED_L4 = {"h3-block": (8448, 33792, 8), "wan-14b-block": (4224, 16896, 20)}


def modes(case: str, floor: int, live: int, chunk: int, n: int) -> list[tuple[str, dict]]:
    below = int(live + 0.8 * floor)       # L3 reaches it (0.77x measured on H3), and so does L4
    c, g, sl = GROUPED_L4[case]
    c, g, sl = max(1, c * n // 217088), (g if chunk > 256 else 2), (sl if chunk > 256 else sl and 64)
    sc, ss, sg = SPANNED_L4[case]
    sc, ss, sg = max(1, sc * n // 217088), max(2, ss * n // 217088), (sg if chunk > 256 else 2)
    return [
        (f"device tier, chunk {chunk}", dict(chunk_tokens=chunk)),
        (f"L4 host, chunk {chunk}", dict(chunk_tokens=chunk, kv="host")),
        (f"L4 host, chunk {c}, {g} head groups, MLP slices of {sl}", dict(chunk_tokens=c, kv="host", head_groups=g,
                                                                          ffn_slice=sl)),
        ("L4 host, planner held to 0.5x floor", dict(budget=int(live + 0.5 * floor), kv="host")),
        (f"L4 host, chunk {sc}, Q spans of {ss}, {sg} head groups",
         dict(chunk_tokens=sc, q_span=ss, kv="host", head_groups=sg)),
        (f"L5 int8, chunk {chunk}", dict(chunk_tokens=chunk, kv="int8")),
        (f"L5 fp8, chunk {chunk}", dict(chunk_tokens=chunk, kv="fp8")),
        ("planner, budget 0.8x floor (L3 or L4: its choice)", dict(budget=below)),
        ("forced L3, budget 0.8x floor", dict(budget=below, head_groups=8)),
        ("forced L4, budget 0.8x floor", dict(budget=below, kv="host")),
    ]


def run_block(case: str, n: int, device: str, chunk: int, dry: bool = False) -> list[dict]:
    torch.manual_seed(0)
    make, real, tiny = BLOCKS[case]
    width = tiny if dry else real
    name, block, inputs, floor = make(n, device, width)
    block = block.to(device).to(width["dtype"]).eval()
    args = inputs()
    live = _live(args)
    kb = lambda b: b / n / 1024  # noqa: E731
    base = {"case": case, "block": name, "tokens": n, "floor_KB_per_token": kb(floor)}
    rows: list[dict] = []
    with torch.inference_mode():
        ref, stock_peak = _peak(lambda: block(*args), device)
        stock_t = _time(lambda: block(*args), device)
        noise = {}
        if device == "cuda":   # stock's own kernel-to-kernel differences: what "exact" in bf16 can mean
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                with sdpa_kernel(backend):
                    noise[f"stock_{name}_vs_default"] = _diff(block(*args), ref)
        rows.append({**base, "mode": "stock", "KB_per_token": kb(stock_peak), "time_s": stock_t, "time_ratio": 1.0,
                     "stock_flash_vs_default_rel_diff": noise.get("stock_flash_vs_default", {}).get("rel"),
                     **noise, **_nonfinite(ref)})
        print(rows[-1], flush=True)
        exact = None
        for label, kw in modes(case, floor, live, chunk, n):
            handle = streamplan.apply(block, capture="prefer", **kw)
            try:
                out, peak = _peak(lambda: block(*args), device)   # first call: plans (and measures L5's error)
                del out
                start = time.perf_counter()
                out, peak = _peak(lambda: block(*args), device)   # measured call (timed too)
                if device == "cuda":
                    torch.cuda.synchronize()
                measured_t = time.perf_counter() - start
            except Exception as exc:   # a budget nothing reaches, or a failure: the row says which, the run goes on
                rows.append({**base, "mode": label, "error": f"{type(exc).__name__}: {exc}"[:300],
                             "traceback": traceback.format_exc()[-1500:]})
                print(rows[-1], flush=True)
                handle.remove()
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                continue
            plan = (handle.plans.get("") or [None])[0]
            if exact is None and plan is not None and plan.kv == "device":
                exact = out
            row = {**base, "mode": label, "KB_per_token": kb(peak), "peak_vs_floor": peak / floor,
                   "vs_stock": _diff(out, ref), "vs_exact_tier": _diff(out, exact) if exact is not None else None,
                   **_nonfinite(out)}
            t = min(measured_t, _time(lambda: block(*args), device, repeats=1))
            row.update({"time_s": t, "time_ratio": t / stock_t, "plan": plan.to_dict() if plan else None,
                        "plan_text": plan.describe() if plan else None,
                        "predicted_KB_per_token": kb(plan.predicted_peak) if plan else None,
                        "notes": [x for e in handle.installed.values() for x in e.runtime_notes]})
            if kw.get("kv") == "int8":
                row["seed_kvi8r_KB_per_token_whole_model"] = SEED_KVI8R_KB_PER_TOKEN
            rows.append(row)
            print(rows[-1], flush=True)
            del out
            handle.remove()
            if device == "cuda":
                torch.cuda.empty_cache()
    del block, args, ref, exact
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# (Q chunk, K/V block, head groups) of the store-alone check at 217,088 rows, scaled with the tokens: the first H200
# run's non-finite plan first
SELF_CHECK = ((33792, 512, 1), (16384, 8192, 1), (12672, 4096, 1), (24576, 24576, 8), (33792, 4096, 7))
BLOCK_CHECK = ((33792, 1, None), (16384, 1, None), (12672, 2, None), (24576, 8, 2048))   # (chunk, groups, ffn_slice)


def _scaled(x: int, n: int) -> int:
    return max(1, x * n // 217088)


def self_check_store(n: int, device: str, dry: bool) -> list[dict]:
    """(a) The K/V store and merge alone at H3's attention width: each Q chunk against the blocks, beside the exact
    tier's call on the same Q and whole K/V, with other work on the device between chunks (as a block has) and nothing
    read back until the end, so the host runs ahead of the device as it does in a block."""
    H, D, dt = (8, 16, torch.float32) if dry else (56, 128, BF16)
    g = torch.Generator(device=device).manual_seed(3)
    k = torch.randn(1, n, H, D, device=device, dtype=dt, generator=g).transpose(1, 2)
    v = torch.randn(1, n, H, D, device=device, dtype=dt, generator=g).transpose(1, 2)
    rows = []
    for chunk, block, groups in SELF_CHECK:
        chunk, block, groups = _scaled(chunk, n), _scaled(block, n), math.gcd(groups, H)
        try:
            rows.append(_check_store(n, device, H, D, dt, k, v, g, chunk, block, groups))
        except Exception as exc:
            rows.append({"check": "store alone", "q_chunk": chunk, "kv_block": block, "head_groups": groups,
                         "error": f"{type(exc).__name__}: {exc}"[:300], "traceback": traceback.format_exc()[-1500:]})
        print(rows[-1], flush=True)
    del k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _check_store(n, device, H, D, dt, k, v, g, chunk, block, groups) -> dict:
    from streamplan.attention import SDPA
    from streamplan.execute.kv_stores import attend_blocks, make_store, write_rows
    st = make_store("host", torch.device(device), block, groups)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        write_rows(st, k[:, :, a:b], v[:, :, a:b], 0, 0, n, a, b, a == 0)
    st.finish()
    start = time.perf_counter()
    found = []   # per Q chunk, on the device: non-finite count, first non-finite flat index, rel. difference
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        q = torch.randn(1, b - a, H, D, device=device, dtype=dt, generator=g).transpose(1, 2)
        out = attend_blocks(SDPA, q, st, q_offset=a, causal=False, scale=None)
        ref = SDPA.attend(q, k, v, q_offset=a, causal=False, mask=None, scale=None)
        churn = torch.empty_like(out).copy_(out).float().mul_(2)   # other work in freed memory, as a block has
        del churn
        nf = (~torch.isfinite(out)).flatten()
        diff = torch.nan_to_num((out.float() - ref.float()).abs(), nan=0.0, posinf=0.0).max()
        found.append((a, b, nf.sum(), nf.int().argmax(), diff / ref.float().abs().max()))
        del out, ref, q
    if device == "cuda":
        torch.cuda.synchronize()
    st.release()
    bad, first, worst = 0, None, 0.0
    for a, b, count, at, rel in found:
        bad += int(count)
        worst = max(worst, float(rel))
        if int(count) and first is None:
            i = int(at)
            first = {"q_row": a + i // D % (b - a), "head": i // (D * (b - a)), "dim": i % D}
    return {"check": "store alone", "tokens": n, "heads": H, "q_chunk": chunk, "kv_block": block,
            "head_groups": groups, "nonfinite": bad, "first_nonfinite": first, "max_rel_vs_exact_call": worst,
            "time_s": time.perf_counter() - start}


def self_check_block(n: int, device: str, dry: bool) -> list[dict]:
    """(b) The whole H3 block under L4 at several chunks and head groups against the exact tier's output."""
    make, real, tiny = BLOCKS["h3-block"]
    width = tiny if dry else real
    torch.manual_seed(0)
    _, block, inputs, _ = make(n, device, width)
    block = block.to(device).to(width["dtype"]).eval()
    args = inputs()
    rows = []
    with torch.inference_mode():
        handle = streamplan.apply(block, capture="prefer", chunk_tokens=_scaled(16384, n))
        exact = block(*args)
        handle.remove()
        for chunk, groups, sl in BLOCK_CHECK:
            chunk, groups = _scaled(chunk, n), math.gcd(groups, width["heads"])
            handle = streamplan.apply(block, capture="prefer", chunk_tokens=chunk, kv="host", head_groups=groups,
                                      ffn_slice=sl and (sl if not dry else 64))
            start = time.perf_counter()
            try:
                out = block(*args)
                if device == "cuda":
                    torch.cuda.synchronize()
                plan = (handle.plans.get("") or [None])[0]
                row = {"check": "H3 block, L4 against the exact tier", "tokens": n, "chunk": chunk,
                       "plan": plan.describe() if plan else None, "vs_exact_tier": _diff(out, exact),
                       **_nonfinite(out), "time_s": time.perf_counter() - start}
                del out
            except Exception as exc:
                row = {"check": "H3 block, L4 against the exact tier", "tokens": n, "chunk": chunk,
                       "error": f"{type(exc).__name__}: {exc}"[:300], "traceback": traceback.format_exc()[-1500:]}
            print(row, flush=True)
            rows.append(row)
            handle.remove()
    del block, args, exact
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    p = script_parser(__doc__)
    p.add_argument("what", nargs="?", type=int_or("smoke", "selfcheck", "dry"), default="smoke",
                   metavar="{TOKENS,smoke,selfcheck,dry}",
                   help="TOKENS: the self-check (without CASES), then the blocks at that length; smoke: 8192 tokens "
                        "on the GPU; selfcheck: the self-check alone; dry: CPU, tiny widths, no GPU needed "
                        "(default: %(default)s)")
    p.add_argument("more", nargs="?", metavar="CASES|TOKENS",
                   help=f"comma-separated blocks, {', '.join(BLOCKS)}: those alone, no self-check (default: both); "
                        "after selfcheck: its tokens (default: 217088)")
    a = p.parse_args(argv[1:])
    what = a.what
    dry = what == "dry"
    device = "cpu" if dry else "cuda"
    check_only = what == "selfcheck"
    try:
        if check_only:
            what = int_or()(a.more) if a.more is not None else "217088"
        cases = name_list(BLOCKS)(a.more) if a.more is not None and not check_only else list(BLOCKS)
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument CASES|TOKENS: {exc}")
    n = 1024 if dry else 8192 if what == "smoke" else int(what)
    chunk = 256 if dry else 2048 if what == "smoke" else 16384
    info = {"device": "cpu (dry run, tiny widths)"} if dry else device_info()
    print(info, flush=True)
    rows: list[dict] = []
    if check_only or a.more is None:
        rows += self_check_store(n, device, dry)
        rows += self_check_block(n, device, dry)
        if not dry:
            write_results(f"gpu_kv_{n}", {**info, "rows": rows})
    if check_only:
        print(write_results(f"gpu_kv_selfcheck_{n}", {**info, "rows": rows}))
        return 0
    for case in cases:
        rows += run_block(case, n, device, chunk, dry)
        if not dry:
            write_results(f"gpu_kv_{n}", {**info, "rows": rows})
    print(write_results(f"gpu_kv_{'dry' if dry else n}", {**info, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
