"""The embedded default job: a real library module at a small width, stock vs streamed, measured."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .api import apply
from .meter import measure_peak


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


CASES = {
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


def run_demo(case: str = "wan-ffn", tokens: int | None = None, device: str | None = None,
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
        handle = apply(model, budget=budget, chunk_tokens=chunk_tokens, ffn_slice=ffn_slice)
        try:
            out, streamed_peak = measure_peak(model, *args, device=dev)
            report = handle.report()
        finally:
            handle.remove()
    diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return DemoResult(case, n, str(dev), str(dtype).replace("torch.", ""), stock_peak, streamed_peak, diff, report)
