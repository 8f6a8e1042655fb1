"""H200: the planner's predictions against the CUDA allocator, and where GEMM throughput flattens.

1. GEMM throughput (bf16) against rows for the projection shapes of Wan2.1-14B and Flux.1: the smallest row count
   reaching 90% of the best is the utilisation floor the planner's smallest chunk should respect.
2. A real-width Wan2.1-14B block at 65,536 and 217,088 tokens, stock and under two budgets each: the plan (tier,
   chunk, predicted peak) and the measured peak, both with the block's inputs counted (a budget covers them).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import streamplan
from common import cuda_peak, cuda_time, device_info, rel_diff, script_parser, write_results

GiB = 2**30


def gemm_floor() -> list[dict]:
    rows = []
    for k, n, label in ((5120, 5120, "Wan q/k/v/o 5120x5120"), (5120, 13824, "Wan ffn up 5120x13824"),
                        (13824, 5120, "Wan ffn down 13824x5120"), (3072, 15360, "Flux single proj 3072x15360")):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        best = 0.0
        series = []
        for m in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = cuda_time(lambda: F.linear(x, w), repeats=20, warmup=3)
            tflops = 2 * m * k * n / t / 1e12
            best = max(best, tflops)
            series.append((m, tflops))
        floor = next(m for m, tf in series if tf >= 0.9 * best)
        rows.append({"shape": label, "tflops_by_rows": series, "best": best, "rows_at_90pct": floor})
        print(rows[-1], flush=True)
    return rows


def wan_block(tokens: int, budgets_over_floor: list[float]) -> list[dict]:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.manual_seed(0)
    block = WanTransformerBlock(5120, 13824, 40, cross_attn_norm=True).cuda().to(torch.bfloat16).eval()
    freqs = torch.randn(1, tokens, 1, 128, device="cuda")
    args = (torch.randn(1, tokens, 5120, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, 512, 5120, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, 6, 5120, device="cuda"), (freqs.cos(), freqs.sin()))
    live = sum(t.numel() * t.element_size() for t in (args[0], args[1], args[2], *args[3]))
    floor = tokens * 5120 * 2 * 3    # residual + K + V
    rows = []
    with torch.inference_mode():
        ref, stock = cuda_peak(lambda: block(*args))
        rows.append({"tokens": tokens, "mode": "stock", "measured_GiB": (stock + live) / GiB,
                     "live_inputs_GiB": live / GiB, "floor_GiB": floor / GiB})
        print(rows[-1], flush=True)
        for factor in budgets_over_floor:
            budget = int(live + factor * floor)
            handle = streamplan.apply(block, budget=budget)
            out, peak = cuda_peak(lambda: block(*args))
            (plan,) = handle.plans[""]
            diff = rel_diff(out, ref)
            del out
            handle.remove()
            rows.append({"tokens": tokens, "mode": f"budget = inputs + {factor} x floor", "budget_GiB": budget / GiB,
                         "tier": plan.tier, "chunk": plan.chunk, "ffn_slice": plan.ffn_slice,
                         "head_groups": plan.head_groups, "predicted_GiB": plan.predicted_total / GiB,
                         "measured_GiB": (peak + live) / GiB,
                         "measured/predicted": (peak + live) / plan.predicted_total,
                         "within_budget": peak + live <= budget, "rel_diff": diff})
            print(rows[-1], flush=True)
    del block, args, ref
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    script_parser(__doc__).parse_args()   # no arguments: --help only
    info = device_info()
    print(info, flush=True)
    payload = {**info, "gemm": gemm_floor(),
               "wan_block": wan_block(65536, [1.6, 1.2]) + wan_block(217088, [1.6, 1.2])}
    print(write_results("gpu_planner", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
