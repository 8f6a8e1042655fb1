"""H200 checks for the foundation and streamed-attention issues, in one run.

1. measure_peak on CUDA vs torch.cuda.max_memory_allocated, and the profiler method (what CPU tests use) vs both.
2. Wan2.1-14B self-attention (dim 5120, 40 heads, rotary) at 65,536 tokens, bf16: stock vs streamed peak, time,
   relative difference, and stock's own kernel-to-kernel noise (flash vs the default SDPA choice).
"""
from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamplan
from common import cuda_peak, cuda_time, device_info, rel_diff, script_parser, write_results
from streamplan.meter import profiler_peak


def _allocator_reference(fn) -> tuple:
    """The reference the meter is checked against: torch.cuda.max_memory_allocated, read here directly."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def meter_check() -> list[dict]:
    from diffusers.models.attention import FeedForward
    rows = []
    ff = FeedForward(5120, inner_dim=13824, activation_fn="gelu-approximate").cuda().to(torch.bfloat16).eval()
    for n in (16384, 65536):
        x = torch.randn(1, n, 5120, device="cuda", dtype=torch.bfloat16)
        for label, chunk in (("stock", None), ("streamed", 4096)):
            handle = streamplan.apply(ff, chunk_tokens=chunk) if chunk else None
            with torch.inference_mode():
                _, meter = streamplan.measure_peak(ff, x)
                _, alloc = _allocator_reference(lambda: ff(x))
                _, prof = profiler_peak(ff, (x,), {}, "cuda")
            if handle:
                handle.remove()
            rows.append({"case": f"FeedForward 5120/13824 {label}", "tokens": n, "measure_peak": meter,
                         "max_memory_allocated": alloc, "profiler_method": prof,
                         "meter/alloc": meter / alloc, "profiler/alloc": prof / alloc})
            print(rows[-1], flush=True)
    del ff
    return rows


def wan_attention(tokens: int, chunks: list[int]) -> list[dict]:
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor
    torch.manual_seed(0)
    attn = WanAttention(5120, heads=40, dim_head=128, eps=1e-6, processor=WanAttnProcessor())
    attn = attn.cuda().to(torch.bfloat16).eval()
    x = torch.randn(1, tokens, 5120, device="cuda", dtype=torch.bfloat16)
    freqs = torch.randn(1, tokens, 1, 128, device="cuda", dtype=torch.float32)
    rotary = (freqs.cos(), freqs.sin())
    rows = []
    with torch.inference_mode():
        ref, stock_peak = cuda_peak(lambda: attn(x, rotary_emb=rotary))
        stock_t = cuda_time(lambda: attn(x, rotary_emb=rotary))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = attn(x, rotary_emb=rotary)
        noise = rel_diff(flash, ref)
        del flash
        rows.append({"case": "WanAttention stock", "tokens": tokens, "peak_bytes": stock_peak,
                     "KB_per_token": stock_peak / tokens / 1024, "time_s": stock_t, "time_ratio": 1.0,
                     "rel_diff": 0.0, "stock_flash_vs_default_rel_diff": noise})
        print(rows[-1], flush=True)
        for chunk in chunks:
            handle = streamplan.apply(attn, chunk_tokens=chunk)
            out, peak = cuda_peak(lambda: attn(x, rotary_emb=rotary))
            t = cuda_time(lambda: attn(x, rotary_emb=rotary))
            plan = handle.plans[""][0]
            handle.remove()
            rows.append({"case": f"WanAttention streamed chunk {chunk}", "tokens": tokens, "peak_bytes": peak,
                         "predicted_peak": plan.predicted_peak, "KB_per_token": peak / tokens / 1024,
                         "time_s": t, "time_ratio": t / stock_t, "rel_diff": rel_diff(out, ref),
                         "peak_vs_stock": peak / stock_peak})
            print(rows[-1], flush=True)
            del out
    return rows


def main() -> int:
    script_parser(__doc__).parse_args()   # no arguments: --help only
    info = device_info()
    print(info, flush=True)
    payload = {**info, "meter": meter_check(), "wan_attention": wan_attention(65536, [4096, 16384])}
    print(write_results("gpu_attention", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
