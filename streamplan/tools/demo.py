"""The embedded default job: a real library module at a small width, stock vs streamed, measured."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..api import apply
from ..execute.call_state import live_bytes
from ..graph.fused_chains import available
from ..meter import measure_peak, profiler_peak
from ..plan.budget import fmt_bytes
from ..timeline import Timeline
from ..verify import compare_outputs


@dataclass
class DemoCase:
    name: str
    description: str
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
    "wan-block": DemoCase("wan-block", "Wan2.1-1.3B WanTransformerBlock (diffusers) at its real width: dim 1536, "
                          "ffn 8960, 12 heads", _wan_block, _wan_block_inputs, 4096),
    "wan-ffn": DemoCase("wan-ffn", "Wan2.1 FeedForward (diffusers) at 1/10 width: dim 512, ffn 1382, gelu-tanh",
                        _wan_ffn, lambda n, dev, dt: (torch.randn(1, n, 512, device=dev, dtype=dt),), 16384),
}


@dataclass
class DemoResult:
    """What the demo measured. Peaks are the meter's (``measure_peak``: bytes a call allocated above what was live when
    it began: inputs and weights); ``input_bytes`` puts them on the report's baseline (the call with its inputs, as a
    budget holds it), on which ``predicted_peak`` is given: one baseline for every figure shown."""

    case: str
    tokens: int
    device: str
    dtype: str
    stock_peak: int             # measured, bytes above the inputs and weights
    streamed_peak: int          # measured, likewise
    max_rel_diff: float
    report: str
    stock_time_s: float = 0.0      # wall time of the stock call (while metering)
    streamed_time_s: float = 0.0   # wall time of the first streamed call (planning included, while metering)
    predicted_peak: int | None = None   # the report's predicted figure: the streamed call's peak with its inputs
    fusing: bool = False        # element-wise chains compiled where found (``apply``'s fuse, here)
    input_bytes: int = 0        # the call's inputs
    timeline: Timeline | None = None   # the streamed call's memory picture (``StreamHandle.timeline``)
    description: str = ""       # what was run, in words

    @property
    def time_ratio(self) -> float:
        return self.streamed_time_s / self.stock_time_s if self.stock_time_s > 0 else float("nan")

    @property
    def stock_total(self) -> int:
        """Stock's measured peak with the call's inputs (the report's baseline)."""
        return self.stock_peak + self.input_bytes

    @property
    def streamed_total(self) -> int:
        """The streamed call's measured peak with its inputs (the report's baseline)."""
        return self.streamed_peak + self.input_bytes

    def summary(self) -> str:
        """What the demo showed, in one plain sentence of measured figures."""
        same = ("the same output as stock (max relative difference 0)" if self.max_rel_diff == 0 else
                f"the same output as stock to a relative difference of {self.max_rel_diff:.1e}"
                if self.max_rel_diff <= 1e-3 else
                f"an output {self.max_rel_diff:.1e} (relative) from stock's")
        less = self.stock_total / max(self.streamed_total, 1)
        return (f"Measured on {self.device}: streamed, {self.description or self.case} at {self.tokens} tokens "
                f"gave {same}, with {less:.1f}x less peak memory than stock ({fmt_bytes(self.streamed_total)} "
                f"against {fmt_bytes(self.stock_total)}, inputs included), in {self.time_ratio:.2f}x stock's time "
                f"(its first call, planning{' and compiling' if self.fusing else ''} included).")


def run_demo(case: str = "wan-block", tokens: int | None = None, device: str | None = None,
             dtype: torch.dtype = torch.float32, budget=None, chunk_tokens: int | None = None,
             ffn_slice: int | None = None, seed: int = 0,
             progress: Callable[[str], None] | None = None, fuse: bool | None = None) -> DemoResult:
    """Build ``case``, run it stock and then streamed on the same input, and measure both (peak memory above the
    inputs, wall time) and their largest output difference. ``progress``, if given, is called with a line of text as
    each stage starts and ends (the command prints them; this function prints nothing). The result keeps the
    streamed call's memory picture (``DemoResult.timeline``): on CPU its measured peaks are the metered call's; on
    CUDA, where the meter reads the allocator's counters, one more streamed call is metered by the profiler for it."""
    if case not in CASES:
        raise ValueError(f"unknown demo case {case!r}; choose from {', '.join(CASES)}")
    spec = CASES[case]
    n = spec.default_tokens if tokens is None else tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tokens must be a whole number of at least 1, got {tokens!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    say = progress or (lambda message: None)
    if chunk_tokens is None and budget is None:
        chunk_tokens = max(256, n // 8)  # the demo shows streaming even where stock would fit
    dtype_name = str(dtype).replace("torch.", "")
    name = spec.description.split(" (")[0]

    started = time.perf_counter()
    say(f"[1/3] building {name} on {dev}, {dtype_name}, random weights ...")
    torch.manual_seed(seed)
    model = spec.build().to(dev, dtype).eval()
    args = spec.inputs(n, dev, dtype)
    inputs = live_bytes(args, {})
    say(f"      done in {time.perf_counter() - started:.1f} s")
    with torch.inference_mode():
        say(f"[2/3] stock run: {n} tokens, metering peak memory ...")
        started = time.perf_counter()
        ref, stock_peak = measure_peak(model, *args, device=dev)
        stock_time = time.perf_counter() - started
        say(f"      done in {stock_time:.1f} s")
        handle = apply(model, budget=budget, chunk_tokens=chunk_tokens, ffn_slice=ffn_slice, fuse=fuse)
        fusing = bool(fuse) or (fuse is None and available(dev))
        try:
            how = f"budget {budget}" if chunk_tokens is None else f"{chunk_tokens}-token chunks"
            compiles = ", its element-wise chains compiled" if fusing else ""
            say(f"[3/3] streamed run: planned at the first call ({how}{compiles}), metering peak memory ...")
            started = time.perf_counter()
            out, streamed_peak = measure_peak(model, *args, device=dev)
            streamed_time = time.perf_counter() - started
            say(f"      done in {streamed_time:.1f} s")
            if dev.type == "cuda":   # the allocator's counters give no per-call peaks: the profiler's events do
                say("      one more streamed call, metered by the profiler for the memory timeline ...")
                del out
                out, _ = profiler_peak(model, args, {}, "cuda")
            timeline = handle.timeline(stock_peak=stock_peak, title=f"{name}, {n} tokens, {dtype_name} on {dev}: "
                                                                        "the streamed call")
            report = handle.report()
            predicted = handle.predicted_peak() or None
        finally:
            handle.remove()
    diff = max(d["rel"] for d in compare_outputs(out, ref).values())
    return DemoResult(case, n, str(dev), dtype_name, stock_peak, streamed_peak, diff, report,
                      stock_time, streamed_time, predicted, fusing, inputs, timeline, name)
