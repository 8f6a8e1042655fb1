"""The GPU benchmark suite behind `streamplan bench` and `benchmarks/gpu_suite.py`: stock, peers and streamplan on
real-width blocks and small whole models, measured with the CUDA allocator and CUDA events in one process."""
from __future__ import annotations

import datetime
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..api import apply
from ..meter import measure_peak, profiler_peak
from .families import FAMILIES
from ..verify import compare_outputs

GiB = 2**30


@dataclass
class Row:
    family: str
    tokens: int
    mode: str
    floor_kb: float
    kb_per_token: float | None = None        # peak activation above weights and inputs
    reserved_kb_per_token: float | None = None
    vs_floor: float | None = None
    time_s: float | None = None
    time_ratio: float | None = None
    rel_diff: float | None = None
    note: str = ""


@dataclass
class Case:
    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]          # on CUDA, in bf16
    floor_bytes_per_token: float
    call: Callable[[nn.Module, tuple], Any] = lambda m, a: m(*a)
    ffn: Callable[[nn.Module], list[nn.Module]] = lambda m: []   # the feed-forwards the naive peer chunks
    extra: dict = field(default_factory=dict)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[-1])
    if hasattr(out, "sample"):
        return out.sample
    if hasattr(out, "logits"):
        return out.logits
    return _first_tensor(out.to_tuple())


def _tensors(args: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in _tensors(a)]
    return []


def _block_case(name: str) -> Case:
    fam = FAMILIES[name]
    dtype = torch.bfloat16

    def ffns(m: nn.Module) -> list[nn.Module]:
        return [getattr(m, n) for n in ("ffn", "ff", "ff_context", "mlp") if hasattr(m, n)]

    def build() -> nn.Module:
        with torch.device("cuda"):   # initialised on the card: real-width weights are slow to make on a CPU
            return fam.build().to(dtype).eval()

    return Case(name, fam.description, build,
                lambda n: fam.inputs(n, torch.device("cuda"), dtype), fam.floor_bytes_per_token(dtype), ffn=ffns)


def _wan_model_case() -> Case:
    def build() -> nn.Module:
        from diffusers import WanTransformer3DModel
        with torch.device("cuda"):
            return WanTransformer3DModel(num_layers=2, text_dim=4096, in_channels=16, out_channels=16,
                                         ffn_dim=13824, num_attention_heads=40, attention_head_dim=128
                                         ).to(torch.bfloat16).eval()

    def inputs(n: int) -> tuple:
        frames = max(1, n // 1560)    # 480p: 60x104 latents, 1560 tokens a frame after 2x2 patches
        return (torch.randn(1, 16, frames, 60, 104, device="cuda", dtype=torch.bfloat16),
                torch.tensor([500], device="cuda"), torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16))

    return Case("wan-14b-model-2-layers", "WanTransformer3DModel (diffusers) at Wan2.1-14B width, 2 layers, 480p",
                build, inputs, 3 * 5120 * 2,
                ffn=lambda m: [b.ffn for b in m.blocks], extra={"tokens_of": lambda n: max(1, n // 1560) * 1560})


def _llama_model_case() -> Case:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          num_hidden_layers=2, vocab_size=128256, attn_implementation="sdpa")
        with torch.device("cuda"):
            return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

    def inputs(n: int) -> tuple:
        return (torch.randint(0, 128256, (1, n), device="cuda"),)

    return Case("llama3-8b-model-2-layers", "LlamaForCausalLM (transformers) at Llama-3-8B width, 2 layers, "
                "prefill with logits for the last token", build, inputs, (4096 + 2 * 1024) * 2,
                call=lambda m, a: m(a[0], logits_to_keep=1, use_cache=False),
                ffn=lambda m: [layer.mlp for layer in m.model.layers])


CASES: dict[str, Callable[[], Case]] = {
    **{name: (lambda name=name: _block_case(name)) for name in
       ("wan-14b-block", "flux-double-block", "flux-single-block", "flux2-double-block", "flux2-single-block",
        "ltx-video-block", "ltx2-block", "hunyuan-double-block", "qwenimage-block", "zimage-block", "llama3-8b-layer",
        "qwen3-moe-layer", "h3-block", "h3-model")},
    "wan-14b-model-2-layers": _wan_model_case,
    "llama3-8b-model-2-layers": _llama_model_case,
}


def _measure(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """(result, peak allocated, peak reserved) above what was there before, with a clean cache to start from."""
    gc.collect()
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved()
    out, peak = measure_peak(fn, device="cuda")    # resets the peak counters, reserved included
    return out, peak, torch.cuda.max_memory_reserved() - base_reserved


def cuda_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (CUDA events) over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


class _NaiveChunkedFFN:
    """The popular peer: each feed-forward runs on chunks of the sequence (torch.chunk), joined by torch.cat."""

    def __init__(self, ffns: list[nn.Module], chunks: int):
        self.ffns, self.chunks = ffns, chunks

    def __enter__(self):
        for ffn in self.ffns:
            stock = ffn.forward
            ffn.forward = lambda x, *a, _stock=stock, **k: torch.cat(
                [_stock(c, *a, **k) for c in x.chunk(self.chunks, dim=1)], dim=1)
        return self

    def __exit__(self, *exc):
        for ffn in self.ffns:
            ffn.__dict__.pop("forward", None)


def run_case(case: Case, tokens_list: list[int], modes: list[str], repeats: int = 3,
             progress: Callable[[str], None] | None = None, kv: str = "device",
             fuse: bool | None = None, replay: bool | None = None, timelines: list | None = None) -> Iterator[Row]:
    """Yield one row per (tokens, mode). Modes: stock, naive-chunked-ffn, forward-chunking, streamplan-<rows>
    (forced chunk), streamplan-<N>GiB (the planner given what an N GiB card leaves after the weights),
    streamplan-floor<x> (the planner given the inputs plus x times the floor). ``progress``, if given, is called
    with a line of text as each stage starts. ``kv``: where the streamplan modes keep K/V (``apply``'s ``kv``).
    ``timelines``: a list each streamplan row's memory picture is appended to (``StreamHandle.timeline``), from one
    more call metered by the profiler's allocation events (the allocator's counters give no per-call peaks)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    say = progress or (lambda message: None)
    started = time.perf_counter()
    elapsed = lambda: f"[{time.perf_counter() - started:6.1f} s]"  # noqa: E731
    say(f"{elapsed()} {case.name}: building on cuda ...")
    torch.manual_seed(0)
    model = case.build()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for n in tokens_list:
        args = case.inputs(n)
        tokens = case.extra.get("tokens_of", lambda n: n)(n)
        floor_kb = case.floor_bytes_per_token / 1024
        kb = lambda b: b / tokens / 1024  # noqa: E731
        with torch.inference_mode():
            say(f"{elapsed()} {case.name}, {tokens} tokens: stock (peak, {repeats} timed runs) ...")
            ref, peak, reserved = _measure(lambda: case.call(model, args))
            stock_peak = peak
            ref = _first_tensor(ref).float()
            stock_t = cuda_time(lambda: case.call(model, args), repeats)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                noise = compare_outputs(_first_tensor(case.call(model, args)), ref)["output"]["rel"]
            if "stock" in modes:
                yield Row(case.name, tokens, "stock", floor_kb, kb(peak), kb(reserved), kb(peak) / floor_kb, stock_t,
                          1.0, 0.0, f"stock flash-vs-default rel diff {noise:.1e}")
            for mode in modes:
                if mode == "stock":
                    continue
                say(f"{elapsed()} {case.name}, {tokens} tokens: {mode} ...")
                if mode == "forward-chunking":
                    if not hasattr(model, "enable_forward_chunking"):
                        yield Row(case.name, tokens, mode, floor_kb, note="not offered by this model")
                        continue
                    model.enable_forward_chunking(chunk_size=4, dim=1)
                    ctx, handle = None, None
                elif mode == "naive-chunked-ffn":
                    ctx, handle = _NaiveChunkedFFN(case.ffn(model), max(1, tokens // 4096)), None
                    ctx.__enter__()
                elif mode.startswith("streamplan-floor"):
                    # the planner held to a multiple of the floor (the budget covers the inputs too)
                    factor = float(mode[len("streamplan-floor"):])
                    inputs = sum(t.numel() * t.element_size() for t in _tensors(args))
                    handle, ctx = apply(model, budget=int(inputs + factor * case.floor_bytes_per_token * tokens),
                                        kv=kv, fuse=fuse, replay=replay), None
                else:
                    size = mode.rsplit("-", 1)[1]
                    if size.endswith("GiB"):
                        handle = apply(model, budget=int(float(size[:-3]) * GiB) - weights, kv=kv, fuse=fuse,
                                       replay=replay)
                    else:
                        handle = apply(model, chunk_tokens=int(size), kv=kv, fuse=fuse, replay=replay)
                    ctx = None
                try:
                    out, peak, reserved = _measure(lambda: case.call(model, args))
                    diff = compare_outputs(_first_tensor(out), ref)["output"]["rel"]
                    del out
                    t = cuda_time(lambda: case.call(model, args), repeats)
                    if timelines is not None and handle is not None:
                        say(f"{elapsed()} {case.name}, {tokens} tokens: {mode}: one more call for the timeline ...")
                        profiler_peak(lambda: case.call(model, args), (), {}, "cuda")
                        timelines.append(handle.timeline(stock_peak=stock_peak, title=f"{case.name}, {tokens} "
                                                         f"tokens, {mode} (bf16, {torch.cuda.get_device_name()})"))
                    tiers = ""
                    if handle is not None:
                        plans = [p for ps in handle.plans.values() for p in ps if not p.note]
                        tiers = ",".join(sorted({f"{p.tier}/{p.chunk}" + (f"/kv={p.kv}" if p.kv != "device" else "")
                                                 for p in plans}))
                    yield Row(case.name, tokens, mode, floor_kb, kb(peak), kb(reserved), kb(peak) / floor_kb, t,
                              t / stock_t, diff, tiers)
                except torch.OutOfMemoryError:
                    yield Row(case.name, tokens, mode, floor_kb, note="out of memory")
                finally:
                    if handle is not None:
                        handle.remove()
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
                    if mode == "forward-chunking":
                        model.disable_forward_chunking()
        del args, ref
    del model
    gc.collect()
    torch.cuda.empty_cache()


def header() -> dict:
    """The device, torch, the date, and how fast this host dispatches: a plan of many short steps is bound by the
    host, whose speed differs between machines of one GPU kind (benchmarks/RESULTS.md), so every result carries it."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "host_us_per_tiny_op": host_dispatch_us()}


def host_dispatch_us(ops: int = 5000) -> float:
    """Microseconds the host takes to enqueue one tiny CUDA op on the current device (the GPU not waited for)."""
    x = torch.zeros(8, device="cuda")
    for _ in range(500):
        x.add_(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    seconds = time.perf_counter() - t
    torch.cuda.synchronize()
    return seconds / ops * 1e6


def to_markdown(rows: list[Row]) -> str:
    lines = ["| family | tokens | mode | KB/token | vs floor | time vs stock | rel. diff | note |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(f"| {r.family} | {r.tokens} | {r.mode} | {fmt(r.kb_per_token, '.1f')} | "
                     f"{fmt(r.vs_floor, '.2f')} | {fmt(r.time_ratio, '.3f')} | {fmt(r.rel_diff, '.1e')} | {r.note} |")
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot(rows: list[dict], path: str) -> None:
    """KB/token and time against stock by token count, one column per family, the floor drawn (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in rows))
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if "expandable" not in m and m != "forward-chunking"]
    fig, axes = plt.subplots(2, len(families), figsize=(3.2 * len(families), 6), squeeze=False)
    for col, fam in enumerate(families):
        fr = [r for r in rows if r["family"] == fam]
        top, bottom = axes[0][col], axes[1][col]
        for mode in modes:
            pts = sorted((r["tokens"], r["kb_per_token"], r["time_ratio"]) for r in fr
                         if r["mode"] == mode and r["kb_per_token"] is not None)
            if pts:
                top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
                bottom.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=mode)
        top.axhline(fr[0]["floor_kb"], color="black", linestyle="--", label="floor (residual+K+V)")
        bottom.axhline(1.0, color="black", linestyle="--")
        top.set_title(fam, fontsize=8)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.tick_params(labelsize=7)
        top.set_ylim(bottom=0)
        if col == 0:
            top.set_ylabel("peak KB/token")
            bottom.set_ylabel("time vs stock")
        bottom.set_xlabel("tokens", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
