"""H200: what cutting Q into row chunks costs the attention kernel alone (issue 11: the H3 block's streamed kernels
spend 1.5-2% more in the attention than stock's one call). One attention at MiniMax-H3's width (56 heads x 128),
bf16, Q laid out as the block gives it ([B, N, H, D] transposed), K/V whole in that layout and in [B, H, N, D]
(streamplan's own buffers may take either); Q attended whole and in chunks of each size, cuDNN and flash; median of
interleaved rounds (CUDA events).

    python benchmarks/gpu_q_chunks.py 65536 4224,8448,12672,16896,33792
"""
from __future__ import annotations

import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import device_info, write_results

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def chunked(q, k, v, chunk: int, backend) -> None:
    with sdpa_kernel(backend):
        for a in range(0, q.shape[2], chunk):
            torch.nn.functional.scaled_dot_product_attention(q[:, :, a:a + chunk], k, v)


def main() -> int:
    info = device_info()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    chunks = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "4224,8448,12672,16896,33792").split(",")]
    heads, dim, rounds = 56, 128, 9
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    kv = {"bshd": (k, v), "bhsd": (k.contiguous(), v.contiguous())}
    cases = [(name, lay, c) for name in BACKENDS for lay in kv for c in [n, *chunks]]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    with torch.inference_mode():
        for name, lay, c in cases:   # warm: kernels chosen, graphs built
            chunked(q, *kv[lay], c, BACKENDS[name])
        for i in range(rounds):
            for case in cases[i % len(cases):] + cases[:i % len(cases)]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                chunked(q, *kv[case[1]], case[2], BACKENDS[case[0]])
                end.record()
                torch.cuda.synchronize()
                times[case].append(start.elapsed_time(end))
    rows = []
    whole = statistics.median(times[("cudnn", "bshd", n)])
    for name, lay, c in cases:
        ms = statistics.median(times[(name, lay, c)])
        rows.append({"backend": name, "kv_layout": lay, "tokens": n, "q_chunk": c, "ms": ms,
                     "vs_cudnn_whole_bshd": ms / whole, "times_ms": times[(name, lay, c)]})
        print(f"{name:6s} K/V {lay} Q chunk {c:6d}: {ms:8.2f} ms  {ms / whole:.4f}x cuDNN whole-Q, K/V bshd",
              flush=True)
    print(write_results(f"gpu_q_chunks_{n}", {**info, "heads": heads, "head_dim": dim, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
