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

    python benchmarks/cpu_figures.py        # ~1 min on 2 CPU cores; JSON to $OUT or benchmarks/results/cpu_figures.json
"""
from __future__ import annotations

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import streamplan  # noqa: E402
from common import write_results  # noqa: E402

MiB = 2 ** 20
THREADS = 2   # the peaks depend on it (CPU attention's per-thread buffers); README's figures are at 2
CHUNK = 256
INPUT = torch.Size([1, 4, 8, 32, 32])   # 8 * 16 * 16 = 2048 rows


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max magnitude (tests/conftest.py's)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


# --- 1. what composes: tests/test_compose.py's model, configurations and steps -----------------------------------

def _wan_model():
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=3,
                                 rope_max_seq_len=64).eval()


def _steps(model, seed=0):
    """Two denoising calls in one cache context, the second on a slightly moved input."""
    from diffusers.hooks import HookRegistry
    g = torch.Generator().manual_seed(seed)
    x, t, enc = torch.randn(INPUT, generator=g), torch.tensor([10]), torch.randn(1, 7, 32, generator=g)
    x2 = x + 1e-3 * torch.randn(INPUT, generator=g)
    outs = []
    HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()
    with torch.no_grad(), model.cache_context("cond"):
        for xi in (x, x2):
            outs.append(model(xi, t, enc).sample)
    return outs


_T = [1000]   # the current timestep, for the caches that ask for it


def _denoise(model, n=4, batch=1, kwargs=False):
    """Four denoising steps, each in its cache context, the latent moved by the output."""
    from diffusers.hooks import HookRegistry
    g = torch.Generator().manual_seed(0)
    x, enc = torch.randn(INPUT, generator=g), torch.randn(batch, 7, 32, generator=g)
    outs = []
    HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()
    with torch.no_grad():
        for i in range(n):
            _T[0] = 1000 - 250 * i
            t = torch.tensor([_T[0]] * batch)
            with model.cache_context("cond", step_index=i, sigma=1 - i / n, num_inference_steps=n):
                xb = torch.cat([x] * batch)
                out = (model(hidden_states=xb, timestep=t, encoder_hidden_states=enc) if kwargs
                       else model(xb, t, enc)).sample
            outs.append(out)
            x = x - 0.1 * out[-1:]
    return outs


def _none(m):
    return m


def _block_level(m):
    from diffusers.hooks import apply_group_offloading
    apply_group_offloading(m, onload_device="cpu", offload_device="cpu", offload_type="block_level",
                           num_blocks_per_group=1)
    return m


def _leaf_level(m):
    from diffusers.hooks import apply_group_offloading
    apply_group_offloading(m, onload_device="cpu", offload_device="cpu", offload_type="leaf_level")
    return m


def _cpu_offload(m):
    from accelerate import cpu_offload
    cpu_offload(m, execution_device=torch.device("cpu"))
    return m


def _casting(m):
    m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return m


def _first_block_cache(m):
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    apply_first_block_cache(m, FirstBlockCacheConfig(threshold=0.05))
    return m


def _lora(m):
    """r=4 on every linear of the blocks, random A and B, block 1's adapters at scale 0.5 (per-block weights)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    m = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]), m).eval()
    for layer in m.blocks[1].modules():
        if isinstance(layer, LoraLayer):
            layer.scaling["default"] = 0.5
    return m


def _int8(m):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    quantize_(m, Int8WeightOnlyConfig())
    return m


def _bnb(bits):
    def apply(model):
        import bitsandbytes as bnb
        for parent in list(model.blocks.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    kw = ({"has_fp16_weights": False} if bits == 8
                          else {"compute_dtype": torch.float32, "quant_type": "nf4"})
                    layer = (bnb.nn.Linear8bitLt if bits == 8 else bnb.nn.Linear4bit)(
                        child.in_features, child.out_features, bias=child.bias is not None, **kw)
                    layer.load_state_dict(child.state_dict())
                    setattr(parent, name, layer.to("cpu").eval())
        return model
    return apply


def _taylorseer(**kw):
    from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache
    return lambda m: apply_taylorseer_cache(m, TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32, **kw))


def _mag_cache(m):
    from diffusers.hooks import MagCacheConfig, apply_mag_cache
    apply_mag_cache(m, MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4, retention_ratio=0.25,
                                      max_skip_steps=1))


def _sea_cache(m):
    from diffusers.hooks import SeaCacheConfig, apply_sea_cache
    apply_sea_cache(m, SeaCacheConfig(threshold=10.0, cache_end_steps=0))


def _pyramid(m):
    from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast
    apply_pyramid_attention_broadcast(m, PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
        spatial_attention_block_identifiers=("blocks",), current_timestep_callback=lambda: _T[0]))


# README label -> (configure the model, steps, apply's extra arguments); the bitsandbytes tests add ffn_slice=64, which
# changes nothing here (the quantised MLPs run row chunks either way: the same peaks)
COMPOSE = {
    "none": (_none, _steps, {}),
    "group offloading, block_level": (_block_level, _steps, {}),
    "group offloading, leaf_level": (_leaf_level, _steps, {}),
    "accelerate cpu_offload": (_cpu_offload, _steps, {}),
    "enable_layerwise_casting (fp8 storage, fp32 compute)": (_casting, _steps, {}),
    "apply_first_block_cache (threshold 0.05)": (_first_block_cache, _steps, {}),
    "peft LoRA, r=4 on every linear of the blocks": (_lora, _steps, {}),
    "torchao Int8WeightOnlyConfig": (_int8, _steps, {}),
    "bitsandbytes 8-bit blocks": (_bnb(8), _steps, {}),
    "bitsandbytes 4-bit blocks": (_bnb(4), _steps, {}),
}
CACHES = {
    "MagCache (mag_ratios all 1, max_skip_steps=1)": _mag_cache,
    "SeaCache (Wan T2V adapter)": _sea_cache,
    "TaylorSeer on every block": _taylorseer(cache_identifiers=[r"blocks\.\d+"]),
    "TaylorSeer on block 0": _taylorseer(cache_identifiers=[r"blocks\.0"]),
    "TaylorSeer lite": _taylorseer(use_lite_mode=True),
    "pyramid attention broadcast": _pyramid,
    "TaylorSeer on attentions": _taylorseer(cache_identifiers=[r"blocks\.\d+\.attn1"]),
}


def compose_row(label: str, configure: Callable, steps: Callable, apply_kw: dict) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _wan_model()
    configured = configure(model)
    if configured is not None:
        model = configured
    ref, stock = streamplan.measure_peak(steps, model, device="cpu")
    handle = streamplan.apply(model, chunk_tokens=CHUNK, **apply_kw)
    steps(model)   # the capture, outside the measurement
    out, streamed = streamplan.measure_peak(steps, model, device="cpu")
    streamed_parts = sorted(n for n, e in handle.installed.items() if e.plans and any(
        str(p.tier) in ("L1", "L2") for p in e.plans.values()))
    handle.remove()
    return {"configuration": label, "stock_mib": stock / MiB, "streamed_mib": streamed / MiB,
            "rel_diff": max(rel_err(o, r) for o, r in zip(out, ref)), "streamed_parts": streamed_parts,
            "apply": {"chunk_tokens": CHUNK, **apply_kw}}


# --- 2. masks over rows: tests/test_row_masks.py's tiny decoders --------------------------------------------------

TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=2, vocab_size=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {"llama": ("llama", {}), "mistral": ("mistral", dict(sliding_window=32))}


def _lm(name: str):
    import transformers
    model_type, overrides = FAMILIES[name]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY_DECODER, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


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

    compose = [compose_row(label, *spec) for label, spec in COMPOSE.items()]
    _table("What composes, two denoising calls (peak MiB; streamed: chunk_tokens=256, captured before)",
           ("configuration", "stock", "streamed", "rel diff"),
           [(r["configuration"], r["stock_mib"], r["streamed_mib"], f"{r['rel_diff']:.1e}") for r in compose])
    caches = [compose_row(label, apply, _denoise, {}) for label, apply in CACHES.items()]
    _table("Four denoising steps, each in its cache context (peak MiB)", ("cache", "stock", "streamed", "rel diff"),
           [(r["configuration"], r["stock_mib"], r["streamed_mib"], f"{r['rel_diff']:.1e}") for r in caches])
    masks = [row_mask_row(name) for name in FAMILIES]
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
