"""The CPU peaks README.md quotes, from the test suite's meter (``streamplan.measure_peak``: the profiler's allocation
events, counting only blocks allocated inside the window), re-derived after the meter's fix for blocks allocated
before the window and freed inside it.

1. What composes (tests/test_compose.py): a tiny ``WanTransformer3DModel`` (3 blocks, 2,048 rows, fp32, onload and
   offload devices both CPU) under each configuration, stock against ``streamplan.apply(model, chunk_tokens=256)``.
   Two denoising calls (group offloading, layerwise casting, first-block cache, accelerate ``cpu_offload``, peft LoRA,
   torchao int8, bitsandbytes 8/4-bit blocks), four denoising steps each in its cache context (MagCache, SeaCache,
   TaylorSeer variants, pyramid attention broadcast). Stock is the configuration's first measured call, as in the
   tests; the streamed call is measured after one unmeasured call (the capture outside the measurement). Outputs are
   compared with the same configuration unstreamed (max abs difference over the largest magnitude).
2. Masks over rows (tests/test_row_masks.py, ``test_padded_peak_is_near_the_floor``): the tiny transformers Llama and
   Mistral, batch 2 with 100 tokens of left padding, 4,096 rows, ``chunk_tokens=64``, ``logits_to_keep=1``; peaks
   over the floor (residual + one layer's K + V, fp32, batch 2). Streamed as the test measures it, right after apply,
   and again once captured.
3. The feed-forward figure (tests/test_mlp.py, ``test_streamed_feedforward_peaks_far_below_stock``): diffusers
   ``FeedForward(512, mult=4)`` (geglu) over 8,192 tokens, stock, row-streamed (1,024-row chunks) and feature-sliced
   (``ffn_slice=512``).

The setups are those of the tests, reproduced here (the test modules need pytest and their conftest). torch runs 2
threads whatever the machine: CPU attention allocates per-thread buffers, so the peaks depend on the thread count.

    python benchmarks/cpu_figures.py        # ~1 min on 2 CPU cores; JSON to $OUT or results/latest/cpu_figures.json
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from typing import Any, Callable

# torch's OpenMP threads wait passively: on a machine whose cores are shared, spinning workers made these tiny calls
# 40x slower; the peaks do not change
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]   # the tests' setups: one copy, measured here
import compose_setups as setups  # noqa: E402
import streamplan  # noqa: E402
from common import write_results  # noqa: E402
from conftest import TINY_DECODER, rel_err  # noqa: E402
from test_row_masks import _lm  # noqa: E402

MiB = 2 ** 20
THREADS = 2   # the peaks depend on it (CPU attention's per-thread buffers); README's figures are at 2
CHUNK = 256


# --- 1. what composes: tests/test_compose.py's model, configurations and steps -----------------------------------

# README label -> how the model is configured (tests/compose_setups.py); the bitsandbytes tests add ffn_slice=64,
# which changes nothing here (the quantised MLPs run row chunks either way: the same peaks)
COMPOSE = {
    "none": lambda m: None,
    "group offloading, block_level": setups.block_level,
    "group offloading, leaf_level": setups.leaf_level,
    "accelerate cpu_offload": setups.sequential_offload,
    "enable_layerwise_casting (fp8 storage, fp32 compute)": setups.casting,
    "apply_first_block_cache (threshold 0.05)": setups.first_block_cache,
    "peft LoRA, r=4 on every linear of the blocks": lambda m: setups.lora(m)[0],
    "torchao Int8WeightOnlyConfig": setups.int8_weight_only,
    "bitsandbytes 8-bit blocks": lambda m: setups.bnb_blocks(m, 8),
    "bitsandbytes 4-bit blocks": lambda m: setups.bnb_blocks(m, 4),
}
CACHES = {
    "MagCache (mag_ratios all 1, max_skip_steps=1)": setups.mag_cache,
    "SeaCache (Wan T2V adapter)": setups.sea_cache,
    "TaylorSeer on every block": setups.taylorseer(cache_identifiers=[r"blocks\.\d+"]),
    "TaylorSeer on block 0": setups.taylorseer(cache_identifiers=[r"blocks\.0"]),
    "TaylorSeer lite": setups.taylorseer(use_lite_mode=True),
    "pyramid attention broadcast": setups.pyramid,
    "TaylorSeer on attentions": setups.taylorseer(cache_identifiers=[r"blocks\.\d+\.attn1"]),
}


def compose_row(label: str, configure: Callable, steps: Callable) -> dict[str, Any]:
    torch.manual_seed(0)
    model = setups.wan_model()
    configure(model)   # in place (peft's injection too)
    ref, stock = streamplan.measure_peak(steps, model, device="cpu")
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    steps(model)   # the capture, outside the measurement
    out, streamed = streamplan.measure_peak(steps, model, device="cpu")
    streamed_parts = sorted(n for n, e in handle.installed.items() if e.plans and any(
        str(p.tier) in ("L1", "L2") for p in e.plans.values()))
    handle.remove()
    return {"configuration": label, "stock_mib": stock / MiB, "streamed_mib": streamed / MiB,
            "rel_diff": max(rel_err(o, r) for o, r in zip(out, ref)), "streamed_parts": streamed_parts,
            "apply": {"chunk_tokens": CHUNK}}


# --- 2. masks over rows: tests/test_row_masks.py's tiny decoders --------------------------------------------------

@torch.no_grad()
def row_mask_row(name: str, n: int = 4096, chunk: int = 64) -> dict[str, Any]:
    model = _lm(name)
    ids = torch.randint(3, TINY_DECODER["vocab_size"], (2, n), generator=torch.Generator().manual_seed(n))
    mask = torch.ones_like(ids)
    mask[0, :100] = 0   # 100 tokens of left padding
    call = lambda: model(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref, stock = streamplan.measure_peak(call, device="cpu")
    handle = streamplan.apply(model, chunk_tokens=chunk)
    out, first = streamplan.measure_peak(call, device="cpu")   # as the test measures it: the capture inside
    out2, captured = streamplan.measure_peak(call, device="cpu")
    handle.remove()
    c = TINY_DECODER
    floor = 2 * n * (c["hidden_size"] + 2 * c["num_key_value_heads"] * c["head_dim"]) * 4
    return {"model": name, "rows": n, "batch": 2, "left_padding": 100, "chunk_tokens": chunk, "floor_mib": floor / MiB,
            "stock_mib": stock / MiB, "streamed_first_call_mib": first / MiB, "streamed_captured_mib": captured / MiB,
            "stock_x_floor": stock / floor, "streamed_first_call_x_floor": first / floor,
            "streamed_captured_x_floor": captured / floor,
            "rel_diff": max(rel_err(out.logits, ref.logits), rel_err(out2.logits, ref.logits))}


# --- 3. the feed-forward figure: tests/test_mlp.py ------------------------------------------------------------------

@torch.no_grad()
def feedforward_row() -> dict[str, Any]:
    from diffusers.models.attention import FeedForward
    torch.manual_seed(0)
    ff = FeedForward(512, mult=4).eval()
    x = torch.randn(1, 8192, 512)
    ref, stock = streamplan.measure_peak(ff, x)
    row = {"module": "FeedForward(512, mult=4, geglu)", "tokens": 8192, "stock_mib": stock / MiB}
    for key, kw in (("rows_1024", dict(chunk_tokens=1024)), ("sliced_512", dict(chunk_tokens=1024, ffn_slice=512))):
        handle = streamplan.apply(ff, **kw)
        out, first = streamplan.measure_peak(ff, x)   # as the test measures it
        _, again = streamplan.measure_peak(ff, x)
        row[f"{key}_mib"], row[f"{key}_second_call_mib"] = first / MiB, again / MiB
        row[f"{key}_rel_diff"] = rel_err(out, ref)
        handle.remove()
    return row


def _table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    print(f"\n{title}")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r))


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    start = time.perf_counter()
    torch.set_num_threads(THREADS)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its fp32-to-fp16 cast note, logged every call
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "meter": "streamplan.measure_peak, CPU (profiler allocation events inside the window)"}
    for pkg in ("diffusers", "transformers", "accelerate", "peft", "torchao", "bitsandbytes"):
        try:
            info[pkg] = __import__(pkg).__version__
        except ImportError:
            info[pkg] = None
    print(info, flush=True)

    compose = [compose_row(label, configure, setups.steps) for label, configure in COMPOSE.items()]
    _table("What composes, two denoising calls (peak MiB; streamed: chunk_tokens=256, captured before)",
           ("configuration", "stock", "streamed", "rel diff"),
           [(r["configuration"], r["stock_mib"], r["streamed_mib"], f"{r['rel_diff']:.1e}") for r in compose])
    caches = [compose_row(label, apply, setups.denoise) for label, apply in CACHES.items()]
    _table("Four denoising steps, each in its cache context (peak MiB)", ("cache", "stock", "streamed", "rel diff"),
           [(r["configuration"], r["stock_mib"], r["streamed_mib"], f"{r['rel_diff']:.1e}") for r in caches])
    masks = [row_mask_row(name) for name in ("llama", "mistral")]
    _table("Masks over rows: batch 2, 100 tokens of left padding, 4,096 rows, chunk 64 (x the floor)",
           ("model", "floor MiB", "stock", "streamed (first call)", "streamed (captured)", "rel diff"),
           [(r["model"], r["floor_mib"], f"{r['stock_x_floor']:.2f}x", f"{r['streamed_first_call_x_floor']:.2f}x",
             f"{r['streamed_captured_x_floor']:.2f}x", f"{r['rel_diff']:.1e}") for r in masks])
    ff = feedforward_row()
    _table("FeedForward(512, mult=4, geglu) over 8,192 tokens (peak MiB)",
           ("stock", "rows, 1024-row chunks", "feature-sliced (ffn_slice=512)"),
           [(ff["stock_mib"], ff["rows_1024_mib"], ff["sliced_512_mib"])])
    info["seconds"] = round(time.perf_counter() - start, 1)
    print(write_results("cpu_figures", {**info, "compose": compose, "caches": caches, "row_masks": masks,
                                        "feedforward": ff}))


if __name__ == "__main__":
    main()
