"""H200: a whole Wan2.1-14B (40 layers, random weights, bf16) under diffusers' block-level group offloading with CUDA
streams (``use_stream=True``: block i+1 onloads on a side stream while block i runs), capped at 24 GiB of the card
(``torch.cuda.set_per_process_memory_fraction``), stock against streamplan (issue 13).

Per token count: stock's absolute peak and time, or its out-of-memory; streamplan's (applied inside the offload
hooks, budget = the cap less a margin); the two outputs' relative difference where stock ran. One forward per mode,
after one cheap warm-up call per mode at a small size (it traces the prefetch order and captures the block graph,
whose row count is symbolic, so the measured call reuses it). Where stock runs out of memory under the cap,
``--uncapped-reference`` runs stock once more without the cap (~100 s at 217,088 tokens) for the comparison.

    python benchmarks/gpu_compose.py --tokens 75600,217088           # ~3-4 min on an H200, JSON under $OUT
    python benchmarks/gpu_compose.py --tokens 8192 --layers 2        # smoke (seconds)
    python benchmarks/gpu_compose.py --cpu-dry-run --tokens 8192 --layers 2 --warmup-tokens 2048 --chunk 1024

Needs diffusers 0.42.1 and safetensors (accelerate optional: without it, group offloading's send_to_device is stood
in for here). Where diffusers is missing, from the repository root with its wheels in .whl/ (gpu-wheels.sh in shared/):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "${TMPDIR:-/tmp}/site" .whl/*.whl && export PYTHONPATH="${TMPDIR:-/tmp}/site:$PWD"
Latents:
75,600 tokens = 720p x 81 frames ([1, 16, 21, 90, 160], patches 1x2x2); 217,088 = 53 latent frames of 128x128
(the DiT-explainer's 10-second case); other counts pick a latent of 64 patch rows by ``tokens // 2048`` frames.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import streamplan  # noqa: E402
from common import device_info, send_to_device_without_accelerate, stage_peaks, write_results  # noqa: E402

BF16 = torch.bfloat16
GiB = 1 << 30
DEV = "cuda"   # --cpu-dry-run: the same steps on the CPU with a tiny model, no streams, no cap, no peaks
LATENTS = {75600: (21, 90, 160), 217088: (53, 128, 128)}   # latent frames, height, width (patches are 1x2x2)


def latent_shape(tokens: int) -> tuple[int, int, int, int, int]:
    if tokens in LATENTS:
        f, h, w = LATENTS[tokens]
    else:
        f, h, w = max(1, tokens // 2048), 64, 128
    return (1, 16, f, h, w)


def build(layers: int, record_stream: bool):
    """Wan2.1-14B's config, random weights built on the card (fast), cast to bf16, then group-offloaded: the weights
    go to pinned host memory and each block comes back for its call."""
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import apply_group_offloading
    torch.manual_seed(0)
    tiny = {} if DEV == "cuda" else dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32,
                                          ffn_dim=64, rope_max_seq_len=64)
    with torch.device(DEV):
        model = WanTransformer3DModel(num_layers=layers, **tiny)   # defaults: 40 heads x 128, ffn 13824, text 4096
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())   # as from_pretrained(torch_dtype=bf16) keeps
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not keep & set(name.split(".")):
            t.data = t.data.to(BF16)
    model = model.eval()
    apply_group_offloading(model, onload_device=torch.device(DEV), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=DEV == "cuda",
                           record_stream=record_stream and DEV == "cuda")
    gc.collect()
    _cuda("empty_cache")
    return model


def _cuda(what: str, *args, default=0):
    return getattr(torch.cuda, what)(*args) if DEV == "cuda" else default


def inputs(tokens: int):
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(latent_shape(tokens), device=DEV, dtype=BF16, generator=g)
    text = torch.randn(1, 512, 4096 if DEV == "cuda" else 32, device=DEV, dtype=BF16, generator=g)
    return x, torch.tensor([500], device=DEV), text


def offload_all(model) -> None:
    """After an out-of-memory inside a forward the groups it onloaded stay on the card: put them back."""
    for m in model.modules():
        reg = getattr(m, "_diffusers_hook", None)
        hook = reg.get_hook("group_offloading") if reg is not None else None
        if hook is not None:
            hook.group.offload_()
    gc.collect()
    _cuda("synchronize")
    _cuda("empty_cache")


def one_call(model, tokens: int) -> dict:
    """One forward: its absolute peak (the cap is absolute), the peak above what was allocated before, wall time."""
    args = inputs(tokens)
    _cuda("synchronize")
    before = _cuda("memory_allocated")
    _cuda("reset_peak_memory_stats")
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model(*args).sample
        _cuda("synchronize")
    except (torch.OutOfMemoryError, streamplan.BudgetError) as exc:
        del args
        offload_all(model)
        return {"oom": True, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "peak_GiB_at_oom": _cuda("max_memory_allocated") / GiB}
    seconds = time.perf_counter() - start
    peak = _cuda("max_memory_allocated")
    del args
    return {"oom": False, "out": out, "time_s": seconds, "peak_GiB": peak / GiB,
            "peak_above_before_GiB": (peak - before) / GiB,
            "KB_per_token_above_before": (peak - before) / tokens / 1024}


def _compare(row: dict, out: torch.Tensor | None, ref: torch.Tensor | None) -> None:
    if out is None or ref is None:
        return
    o, r = out.float(), ref.float()
    row["rel_diff_vs_stock"] = ((o - r).norm() / r.norm()).item()
    row["bit_identical"] = bool(torch.equal(out, ref))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="75600,217088", help="comma-separated token counts")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--cap-gib", type=float, default=24.0, help="set_per_process_memory_fraction, in GiB")
    p.add_argument("--margin-gib", type=float, default=1.0, help="streamplan's budget is the cap less this")
    p.add_argument("--chunk", type=int, default=0, help="fixed row chunks instead of the budget")
    p.add_argument("--record-stream", action="store_true", help="group offloading's record_stream=True")
    p.add_argument("--uncapped-reference", action="store_true",
                   help="where stock runs out of memory under the cap, run stock once without it to compare outputs")
    p.add_argument("--modes", default="stock,streamplan", help="which of stock, streamplan to run, in that order")
    p.add_argument("--stages", action="store_true",
                   help="streamplan's call once more under common.stage_peaks: CUDA peaks per block call")
    p.add_argument("--warmup-tokens", type=int, default=4096)
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default $OUT, else benchmarks/results/latest)")
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU, tiny width, no streams")
    a = p.parse_args()
    modes = a.modes.split(",")
    if any(m not in ("stock", "streamplan") for m in modes):
        p.error(f"--modes takes stock and/or streamplan, got {a.modes!r}")
    global DEV
    if a.cpu_dry_run:
        DEV = "cpu"
    missing = [m for m in ("diffusers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing: {', '.join(missing)} (shared/tools/gpu-wheels.sh puts diffusers' wheels in .whl/; install "
              "them as that script says)", file=sys.stderr)
        return 2
    send_to_device_without_accelerate()
    if a.out_dir:
        os.environ["OUT"] = a.out_dir
    info = device_info() if DEV == "cuda" else {"device": "cpu dry run", "torch": torch.__version__}
    print(info, flush=True)
    total = torch.cuda.get_device_properties(0).total_memory if DEV == "cuda" else 1
    model = build(a.layers, a.record_stream)
    cap = int(a.cap_gib * GiB)
    base = {**info, "model": f"WanTransformer3DModel, Wan2.1-14B config, {a.layers} layers, random weights, bf16",
            "offload": "apply_group_offloading(block_level, num_blocks_per_group=1, use_stream=True, "
                       f"record_stream={a.record_stream}), onload cuda, offload cpu (pinned)",
            "cap_GiB": a.cap_gib, "streamplan": f"chunk_tokens={a.chunk}" if a.chunk else
            f"budget={a.cap_gib - a.margin_gib} GiB", "rows": []}
    rows = base["rows"]
    name = f"gpu_compose_wan14b_{a.layers}l" + ("_record" if a.record_stream else "")
    _cuda("set_per_process_memory_fraction", min(1.0, cap / total))
    counts = [int(t) for t in a.tokens.split(",")]
    refs: dict[int, torch.Tensor | None] = {}
    for mode in [m for m in ("stock", "streamplan") if m in modes]:
        handle = None
        if mode == "streamplan":
            opts = dict(chunk_tokens=a.chunk) if a.chunk else dict(budget=cap - int(a.margin_gib * GiB))
            handle = streamplan.apply(model, **opts)
        warm = one_call(model, a.warmup_tokens)   # prefetch order traced, graph captured, kernels loaded
        print({"mode": mode, "warmup_tokens": a.warmup_tokens, "time_s": warm.get("time_s"), "oom": warm["oom"]},
              flush=True)
        for tokens in counts:
            r = one_call(model, tokens)
            out = r.pop("out", None)
            out = out.cpu() if out is not None else None
            row = {"mode": mode, "tokens": tokens, "latent": list(latent_shape(tokens)), **r}
            if mode == "stock":
                refs[tokens] = out
            else:
                _compare(row, out, refs.get(tokens))
                refs[tokens] = (refs.get(tokens), out)   # stock's and streamplan's, for an uncapped reference
                plans = handle.plans.get("blocks.0", [])
                row["block_plans"] = [{"tier": str(pl.tier), "chunk": pl.chunk, "rows": pl.rows,
                                       "predicted_GiB": pl.predicted_peak / GiB} for pl in plans]
                row["model_notes"] = handle.installed[""].runtime_notes[-3:] if "" in handle.installed else []
                if a.stages and DEV == "cuda" and not r["oom"]:   # the call again, its peak block call by block call
                    del out
                    gc.collect()
                    with stage_peaks(modules=[("patch_embedding", model.patch_embedding)]) as probe:
                        r2 = one_call(model, tokens)
                    r2.pop("out", None)
                    row["stages"] = probe.rows
                    row["stages_worst"] = max(probe.rows, key=lambda x: x["peak_GiB"]) if probe.rows else None
                    out = None
            del out
            gc.collect()
            _cuda("empty_cache")
            rows.append(row)
            print(row, flush=True)
            write_results(name, base)
        if handle is not None:
            base["report"] = handle.report()
            handle.remove()
    if a.uncapped_reference:   # stock without the cap where it ran out of memory under it
        _cuda("set_per_process_memory_fraction", 1.0)
        for tokens in counts:
            stock_out, streamed = refs[tokens]
            if stock_out is not None or streamed is None:
                continue
            r = one_call(model, tokens)
            out = r.pop("out", None)
            row = next(x for x in rows if x["mode"] == "streamplan" and x["tokens"] == tokens)
            row["uncapped_stock"] = r
            _compare(row, streamed, out.cpu() if out is not None else None)
            del out
            print(row, flush=True)
            write_results(name, base)
    for tokens in [int(t) for t in a.tokens.split(",")]:
        s = next((r for r in rows if r["mode"] == "stock" and r["tokens"] == tokens), {})
        t = next((r for r in rows if r["mode"] == "streamplan" and r["tokens"] == tokens), {})
        print(f"{tokens} tokens: stock " + ("OOM" if s.get("oom") else f"{s.get('peak_GiB', 0):.2f} GiB "
                                            f"{s.get('time_s', 0):.1f} s")
              + " | streamplan " + ("OOM" if t.get("oom") else f"{t.get('peak_GiB', 0):.2f} GiB "
                                    f"{t.get('time_s', 0):.1f} s, rel diff {t.get('rel_diff_vs_stock')}"), flush=True)
    print(write_results(name, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
