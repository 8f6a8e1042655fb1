"""The embedded default job: a real library module at a small width, stock vs streamed, measured."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .api import apply
from .meter import measure_peak
from .verify import compare_outputs


@dataclass
class DemoCase:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device, torch.dtype], tuple]
    default_tokens: int


def _wan_ffn() -> nn.Module:
    from diffusers.models.attention import FeedForward
    # the feed-forward of a Wan2.1 block at 1/10 width (real: dim 5120, ffn 13824, gelu-tanh)
    return FeedForward(512, inner_dim=1382, activation_fn="gelu-approximate")


def _wan_block() -> nn.Module:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    # a Wan2.1-1.3B block at its real width: dim 1536, ffn 8960, 12 heads
    return WanTransformerBlock(1536, 8960, 12, cross_attn_norm=True)


def _wan_block_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    freqs = torch.randn(1, n, 1, 128, device=dev)
    return (torch.randn(1, n, 1536, device=dev, dtype=dt), torch.randn(1, 512, 1536, device=dev, dtype=dt),
            torch.randn(1, 6, 1536, device=dev), (freqs.cos(), freqs.sin()))


CASES = {
    "wan-block": DemoCase("wan-block", _wan_block, _wan_block_inputs, 4096),
    "wan-ffn": DemoCase("wan-ffn", _wan_ffn, lambda n, dev, dt: (torch.randn(1, n, 512, device=dev, dtype=dt),),
                        16384),
}


@dataclass
class DemoResult:
    case: str
    tokens: int
    device: str
    dtype: str
    stock_peak: int
    streamed_peak: int
    max_rel_diff: float
    report: str


def run_demo(case: str = "wan-block", tokens: int | None = None, device: str | None = None,
             dtype: torch.dtype = torch.float32, budget=None, chunk_tokens: int | None = None,
             ffn_slice: int | None = None, seed: int = 0) -> DemoResult:
    spec = CASES[case]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model = spec.build().to(dev, dtype).eval()
    n = tokens or spec.default_tokens
    args = spec.inputs(n, dev, dtype)
    with torch.inference_mode():
        ref, stock_peak = measure_peak(model, *args, device=dev)
        if chunk_tokens is None and budget is None:
            chunk_tokens = max(256, n // 8)  # the demo shows streaming even where stock would fit
        handle = apply(model, budget=budget, chunk_tokens=chunk_tokens, ffn_slice=ffn_slice)
        try:
            out, streamed_peak = measure_peak(model, *args, device=dev)
            report = handle.report()
        finally:
            handle.remove()
    diff = max(d["rel"] for d in compare_outputs(out, ref).values())
    return DemoResult(case, n, str(dev), str(dtype).replace("torch.", ""), stock_peak, streamed_peak, diff, report)
