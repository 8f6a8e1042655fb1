"""H200: real-width blocks at long sequences, bf16, stock vs streamed (copied input and donated input).

Wan2.1-14B ``WanTransformerBlock`` (dim 5120, ffn 13824, 40 heads, 512 text tokens) and Flux.1
``FluxSingleTransformerBlock`` (dim 3072, 24 heads, 512 text tokens): peak KB/token above inputs and weights
(CUDA allocator), time ratio to stock (median of 3), relative difference to stock, and stock's own
kernel-to-kernel noise (flash vs the default SDPA choice) for scale.
"""
from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamplan
from common import cuda_peak, cuda_time, device_info, rel_diff, script_parser, write_results
from streamplan.execute.donation import donate


def _first(out):
    return out[1] if isinstance(out, tuple) else out


def bench(name: str, block, make_args, tokens: int, floor_bytes: int, chunks: list[int]) -> list[dict]:
    rows = []
    args = make_args()
    with torch.inference_mode():
        ref, stock_peak = cuda_peak(lambda: block(*args))
        ref = _first(ref)
        stock_t = cuda_time(lambda: block(*args), repeats=3)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            noise = rel_diff(_first(block(*args)), ref)
        base = {"block": name, "tokens": tokens, "floor_KB_per_token": floor_bytes / tokens / 1024}
        rows.append({**base, "mode": "stock", "KB_per_token": stock_peak / tokens / 1024, "time_s": stock_t,
                     "time_ratio": 1.0, "rel_diff": 0.0, "stock_flash_vs_default_rel_diff": noise})
        print(rows[-1], flush=True)
        for chunk in chunks:
            handle = streamplan.apply(block, chunk_tokens=chunk)
            out, peak = cuda_peak(lambda: block(*args))
            diff = rel_diff(_first(out), ref)
            del out
            t = cuda_time(lambda: block(*args), repeats=3)
            plan = handle.plans[""][0]
            rows.append({**base, "mode": f"streamed chunk {chunk} (input copied)", "KB_per_token": peak / tokens / 1024,
                         "predicted_KB_per_token": plan.predicted_peak / tokens / 1024, "time_s": t,
                         "time_ratio": t / stock_t, "rel_diff": diff, "peak_vs_floor": peak / floor_bytes})
            print(rows[-1], flush=True)

            def donated():
                fresh = make_args()
                with donate(*[a for a in fresh if isinstance(a, torch.Tensor)]):
                    return block(*fresh)

            torch.cuda.synchronize()
            fresh_bytes = sum(a.numel() * a.element_size() for a in make_args() if isinstance(a, torch.Tensor))
            out, peak = cuda_peak(donated)
            del out
            peak = max(0, peak - fresh_bytes)  # the inputs made inside are not activation memory
            rows.append({**base, "mode": f"streamed chunk {chunk} (input donated, as in a streamed model)",
                         "KB_per_token": peak / tokens / 1024, "peak_vs_floor": peak / floor_bytes})
            print(rows[-1], flush=True)
            handle.remove()
    return rows


def wan(tokens: int, chunks: list[int]) -> list[dict]:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.manual_seed(0)
    block = WanTransformerBlock(5120, 13824, 40, cross_attn_norm=True).cuda().to(torch.bfloat16).eval()
    freqs = torch.randn(1, tokens, 1, 128, device="cuda")
    rotary = (freqs.cos(), freqs.sin())
    gen = torch.Generator(device="cuda").manual_seed(1)

    def make_args():
        gen.manual_seed(1)
        return (torch.randn(1, tokens, 5120, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(1, 512, 5120, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(1, 6, 5120, device="cuda", dtype=torch.float32, generator=gen), rotary)

    floor = tokens * 5120 * 2 * 3
    rows = bench("Wan2.1-14B WanTransformerBlock", block, make_args, tokens, floor, chunks)
    del block
    torch.cuda.empty_cache()
    return rows


def flux_single(tokens: int, chunks: list[int]) -> list[dict]:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(3072, 24, 128).cuda().to(torch.bfloat16).eval()
    text = 512
    freqs = torch.randn(text + tokens, 128, device="cuda")
    rotary = (freqs.cos(), freqs.sin())
    gen = torch.Generator(device="cuda").manual_seed(1)

    def make_args():
        gen.manual_seed(1)
        return (torch.randn(1, tokens, 3072, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(1, text, 3072, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16, generator=gen), rotary)

    floor = (tokens + text) * 3072 * 2 * 3
    rows = bench("Flux.1 FluxSingleTransformerBlock", block, make_args, tokens, floor, chunks)
    del block
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("tokens", nargs="?", type=int, default=131072, help="sequence length (default: %(default)s)")
    tokens = p.parse_args().tokens
    info = device_info()
    print(info, flush=True)
    payload = {**info, "rows": wan(tokens, [4096, 16384]) + flux_single(tokens, [4096, 16384])}
    print(write_results(f"gpu_blocks_{tokens}", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
