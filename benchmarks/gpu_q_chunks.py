"""H200: what cutting Q into row chunks costs the attention kernel alone (issue 11: the H3 block's streamed kernels
spend 1.5-2% more in the attention than stock's one call). One attention at MiniMax-H3's width (56 heads x 128),
bf16, Q laid out as the block gives it ([B, N, H, D] transposed), K/V whole in that layout and in [B, H, N, D]
(streamplan's own buffers may take either); Q attended whole and in chunks of each size, cuDNN and flash; median of
interleaved rounds (CUDA events).

    python benchmarks/gpu_q_chunks.py 65536 4224,8448,12672,16896,33792
    python benchmarks/gpu_q_chunks.py 65536 12672 gemm   # a chunk's GEMMs before each attention call (as a
        # block's phase Q runs them), the attention calls alone timed: does the work around them slow them?
"""
from __future__ import annotations

import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import device_info, int_list, script_parser, write_results

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def chunked(q, k, v, chunk: int, backend, gemm=None) -> float:
    """Milliseconds in the attention calls (CUDA events around each); ``gemm``: (x, w) multiplied before each."""
    total, marks = 0.0, []
    with sdpa_kernel(backend):
        for a in range(0, q.shape[2], chunk):
            if gemm is not None:
                x, w = gemm
                for _ in range(3):
                    torch.mm(x[:min(chunk, q.shape[2] - a)], w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.nn.functional.scaled_dot_product_attention(q[:, :, a:a + chunk], k, v)
            end.record()
            marks.append((start, end))
    torch.cuda.synchronize()
    for start, end in marks:
        total += start.elapsed_time(end)
    return total


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("tokens", nargs="?", type=int, default=65536, help="sequence length (default: %(default)s)")
    p.add_argument("chunks", nargs="?", type=int_list, default="4224,8448,12672,16896,33792",
                   help="comma-separated Q chunk sizes, each timed beside Q whole (default: %(default)s)")
    p.add_argument("gemm", nargs="?", choices=("gemm",),
                   help="gemm: cuDNN in the block's layout only, each chunk's GEMMs run before its attention call")
    a = p.parse_args()
    info = device_info()
    n, chunks = a.tokens, a.chunks
    heads, dim, rounds = 56, 128, 9
    between = a.gemm == "gemm"
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    kv = {"bshd": (k, v), "bhsd": (k.contiguous(), v.contiguous())}
    cases = [(name, lay, c) for name in BACKENDS for lay in kv for c in [n, *chunks]]
    if between:   # cuDNN, the block's layout, alone and with the GEMMs between
        x = torch.randn(n, 5376, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(5376, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
        cases = [("cudnn", "bshd", c, m) for c in [n, *chunks] for m in ("alone", "gemm")]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    with torch.inference_mode():
        def one(case) -> float:
            gemm = (x, w) if len(case) > 3 and case[3] == "gemm" else None
            return chunked(q, *kv[case[1]], case[2], BACKENDS[case[0]], gemm)

        for case in cases:   # warm: kernels chosen, graphs built
            one(case)
        for i in range(rounds):
            for case in cases[i % len(cases):] + cases[:i % len(cases)]:
                times[case].append(one(case))
    rows = []
    whole = statistics.median(times[cases[0]])
    for case in cases:
        name, lay, c = case[:3]
        ms = statistics.median(times[case])
        rows.append({"backend": name, "kv_layout": lay, "tokens": n, "q_chunk": c, "ms": ms,
                     "between": case[3] if len(case) > 3 else "alone",
                     "vs_cudnn_whole_bshd": ms / whole, "times_ms": times[case]})
        print(f"{name:6s} K/V {lay} Q chunk {c:6d} {rows[-1]['between']:5s}: {ms:8.2f} ms in attention  "
              f"{ms / whole:.4f}x cuDNN whole-Q alone", flush=True)
    name = f"gpu_q_chunks_{n}" + ("_gemm" if between else "")
    print(write_results(name, {**info, "heads": heads, "head_dim": dim, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
