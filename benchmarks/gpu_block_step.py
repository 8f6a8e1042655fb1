"""GPU: one block step of a K/V store's pass, op by op: the host's enqueue time and the GPU's time of the attention
call on cuDNN and on flash (both with their log-sum-exp), and of the fused accumulator, at store-block shapes; the
host's own speed (a tiny op's enqueue); and two key halves merged through each kernel's log-sum-exp against one fp32
call. Why: short-block store plans are bound by the host (benchmarks/RESULTS.md, "how much the host matters"); this
says which op costs the host what, and whether another kernel would cost it less.

    python benchmarks/gpu_block_step.py
"""
from __future__ import annotations

import sys
import time

import torch

from common import device_info, script_parser, write_results
from streamplan.attention.lse_merge import LseAccumulator
from streamplan.attention.sdpa import _cudnn_with_lse, _flash_with_lse

# (heads, query rows, key rows): a head group's block steps of the 0.5x plans, then whole-headed long blocks
SHAPES = ((6, 1280, 2048), (6, 7680, 2048), (8, 2048, 512), (24, 4096, 4096), (24, 16896, 16384), (40, 4096, 4096))


def timed(fn, n: int = 200) -> tuple[float, float]:
    """(host enqueue us, GPU us) per call, over ``n`` calls after five."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    enqueue = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return enqueue * 1e6, start.elapsed_time(end) / n * 1e3


def main() -> int:
    parser = script_parser(__doc__)
    parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times CUDA kernels and their enqueue)")
    rows = []
    info = device_info()   # with the host's speed (``host_us_per_tiny_op``)
    print(info, flush=True)
    for H, c, n in SHAPES:
        q = torch.randn(1, c, H, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, n, H, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn_like(k)
        # the ATen ops the consumer's ``attend_lse`` calls (attention/sdpa.py), bare
        cudnn = timed(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False,
                                                                                 False))
        flash = timed(lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False))
        o, lse = _cudnn_with_lse(q, k, v, False, None)
        acc = LseAccumulator(q)
        accumulate = timed(lambda: acc.add(o, lse))
        rows.append({"heads": H, "q_rows": c, "k_rows": n, "cudnn_enqueue_us": cudnn[0], "cudnn_gpu_us": cudnn[1],
                     "flash_enqueue_us": flash[0], "flash_gpu_us": flash[1], "accumulate_enqueue_us": accumulate[0],
                     "accumulate_gpu_us": accumulate[1]})
        print(f"H{H} q{c} k{n}: cudnn enqueue {cudnn[0]:.1f} us gpu {cudnn[1]:.1f} us | flash enqueue "
              f"{flash[0]:.1f} us gpu {flash[1]:.1f} us | accumulate enqueue {accumulate[0]:.1f} gpu "
              f"{accumulate[1]:.1f}", flush=True)
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    merged = {}
    for name, kernel in (("flash", _flash_with_lse), ("cudnn", _cudnn_with_lse)):
        acc = LseAccumulator(q)
        for a in (0, 2048):
            o, lse = kernel(q, k[:, :, a:a + 2048], v[:, :, a:a + 2048], False, None)
            acc.add(o, lse.float())
        merged[name] = ((acc.result(torch.float32) - whole).abs().max() / whole.abs().max()).item()
        print(f"{name} merged vs fp32 whole: {merged[name]}", flush=True)
    print(write_results("gpu_block_step", {**info, "rows": rows, "merged_rel_vs_fp32": merged}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
