"""H200: a byte budget on a whole Wan2.1-14B forward is a promise (issue 29). Weights on the card, random, bf16; the
budget is the device memory the forward may add above what was allocated when it began. For each budget the card is
simulated by ``set_per_process_memory_fraction`` at what was allocated + the budget + a small allowance for the
allocator's rounding (expandable segments on): an accepted budget must run under that cap, its measured peak within
the budget; a refused one must raise ``BudgetError`` before anything runs (no memory allocated), naming the smallest
budget that runs. Stock is timed in the same process; times are the second call (the first rehearses and captures,
timed apart).

With ``--offload`` the weights go to pinned host memory after stock's reference run (diffusers' block-level group
offloading, a CUDA stream prefetching the next block): the budget then covers the weights the hooks bring in too,
and stock's reference is the uncapped stock forward with its weights on the card. A small call first
(``--warmup-tokens``) captures the block graph and lets the offload hooks learn their prefetch order; each budget's
first call at full length rehearses (its seconds parsed from the report's note and taken out of ``first_call_s``),
then ``--repeat`` calls are timed whole.

    python benchmarks/gpu_forward_budget.py --layers 2 --tokens 217088 --budgets-gib 7,8,10 --refuse-gib 4
    python benchmarks/gpu_forward_budget.py --layers 40 --offload --budgets-gib 6 --refuse-gib 4 --repeat 1
    python benchmarks/gpu_forward_budget.py --model h3 --layers 50 --offload --tokens 217056 --budgets-gib 8
    python benchmarks/gpu_forward_budget.py --model ltx2 --layers 48 --offload --tokens 206040 --budgets-gib 12
    python benchmarks/gpu_forward_budget.py --model llama --layers 8 --tokens 1048576 --budgets-gib 3 --refuse-gib 1
    python benchmarks/gpu_forward_budget.py --model llama --layers 6 --tokens 1048576 --stock-once \
        --card-budgets-gib 2 --offload --budgets-gib 3 --refuse-gib 0 --repeat 0
    python benchmarks/gpu_forward_budget.py --cpu-dry-run      # the same steps on the CPU with a tiny model

A reference that takes most of a device call (Llama-3-8B width, 32 layers, 1M tokens: ~9 min) runs in a call of its
own: ``--stock-save stock_llama_1m.pt`` there, then ``--stock-from <that file, carried> --card-budgets-gib 17``.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import re
import sys
import time

# the docstring's promise: a capped card's reserved memory counts, so the allocator must not strand blocks (a 2-layer
# Llama at 217,088 tokens under its smallest budget ran out of memory with 631 MiB reserved but unallocated without it)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import streamplan  # noqa: E402
from common import CAP_ALLOWANCE, cap_card  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
GIB = 1 << 30
HIDDEN = "auto"         # apply(hidden=...): where the forward keeps its hidden state (--hidden)
TRUTH = None            # --stock-fp32: the same stock forward in fp32, each output's error measured against it
LATENTS = {32768: (8, 64, 256), 75600: (21, 90, 160), 217088: (53, 128, 128),   # frames, height, width (1x2x2 patches)
           434176: (106, 128, 128)}


def build(layers: int):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    tiny = {} if DEV == "cuda" else dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32,
                                          ffn_dim=64, rope_max_seq_len=64, in_channels=4, out_channels=4)
    with torch.device(DEV):
        model = WanTransformer3DModel(num_layers=layers, **tiny)   # defaults: 40 heads x 128, ffn 13824, text 4096
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not keep & set(name.split(".")):
            t.data = t.data.to(BF16 if DEV == "cuda" else torch.float32)
    return model.eval()


def build_llama(layers: int):
    """Llama-3-8B width (4096 wide, 32 heads over 8 K/V heads, MLP 14336, vocab 128256), ``layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    size = (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256) if DEV == "cuda" else
            dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    cfg = LlamaConfig(**size, num_hidden_layers=layers, max_position_embeddings=1 << 21, rope_theta=500000.0,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEV):
        return LlamaForCausalLM(cfg).to(BF16 if DEV == "cuda" else torch.float32).eval()


def build_h3(layers: int):
    """MiniMax-H3 at its real width (5376 wide, 56 heads x 128, SwiGLU 14336), ``layers`` layers, 2 refiners; its
    input and output projections and time embedder in fp32 as the pipeline keeps them."""
    from diffusers import MiniMaxH3Transformer3DModel
    tiny = {} if DEV == "cuda" else dict(num_attention_heads=4, attention_head_dim=16, hidden_size=64, ffn_dim=128,
                                          in_channels=4, audio_in_channels=8, text_dim=48, freq_dim=32,
                                          time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=2)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = MiniMaxH3Transformer3DModel(num_layers=layers, num_refiner_layers=2, **tiny)
    model = model.to(BF16 if DEV == "cuda" else torch.float32)
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        getattr(model, name).float()
    return model.eval()


def h3_inputs(model, tokens: int, text: int = 512, audio: int = 2000, cond: int = 4096) -> dict:
    """The packed sequence as the pipeline hands it: text, audio, then video rows (the first ``cond`` of them
    conditioning frames at t=0, the rest at the noisy level); ``tokens`` counts every packed row."""
    if DEV != "cuda":
        text, audio, cond = 24, 30, 40
    cfg = model.config
    video = tokens - text - audio
    g = torch.Generator(device=DEV).manual_seed(1)
    idx = torch.arange(tokens, device=DEV)
    tags = torch.zeros(tokens, dtype=torch.long, device=DEV)
    tags[text:text + audio] = 2
    tags[:text] = 1
    ts = torch.ones(tokens, dtype=torch.long, device=DEV)
    ts[text + audio:text + audio + cond] = 0
    p = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return dict(hidden_states=torch.randn(1, video, cfg.in_channels * p, device=DEV, generator=g),
                audio_hidden_states=torch.randn(1, audio, cfg.audio_in_channels, device=DEV, generator=g),
                encoder_hidden_states=torch.randn(1, text, cfg.text_dim, device=DEV, generator=g,
                                                  dtype=BF16 if DEV == "cuda" else torch.float32),
                timestep=torch.tensor([0.0, 0.6], device=DEV), timestep_indices=ts, token_tags=tags,
                position_ids=torch.randint(0, 64, (tokens, 3), device=DEV, generator=g),
                video_indices=idx[text + audio:], audio_indices=idx[text:text + audio], text_indices=idx[:text])


def build_ltx2(layers: int):
    """LTX-2 at its real width (4096-wide video over 32 heads, 2048-wide audio, caption 3840), ``layers`` layers."""
    from diffusers import LTX2VideoTransformer3DModel
    tiny = {} if DEV == "cuda" else dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                                          cross_attention_dim=32, audio_in_channels=8, audio_out_channels=8,
                                          audio_num_attention_heads=2, audio_attention_head_dim=8,
                                          audio_cross_attention_dim=16, caption_channels=24)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LTX2VideoTransformer3DModel(num_layers=layers, **tiny)
    return model.to(BF16 if DEV == "cuda" else torch.float32).eval()


LTX2_LATENTS = {206040: (101, 34, 60), 75600: (21, 60, 60), 32768: (8, 64, 64)}   # frames, height, width (1x1x1)


def ltx2_inputs(model, tokens: int, text: int = 1024) -> dict:
    """The image-to-video call: per-token timesteps (the first latent frame clean), 25 audio rows a second of 24 fps
    video, ``tokens`` video rows."""
    f, h, w = LTX2_LATENTS.get(tokens, (max(1, tokens // 2040), 34, 60))
    if DEV != "cuda":
        f, h, w, text = 3, 8, 10, 7
    cfg = model.config
    audio = max(2, round((f - 1) * 8 / 24 * 25) + 1) if DEV == "cuda" else 12
    dtype = BF16 if DEV == "cuda" else torch.float32
    g = torch.Generator(device=DEV).manual_seed(1)
    n = f * h * w
    timestep = torch.full((1, n), 700.0, device=DEV)
    timestep[:, :h * w] = 0.0
    return dict(hidden_states=torch.randn(1, n, cfg.in_channels, device=DEV, dtype=dtype, generator=g),
                audio_hidden_states=torch.randn(1, audio, cfg.audio_in_channels, device=DEV, dtype=dtype, generator=g),
                encoder_hidden_states=torch.randn(1, text, cfg.caption_channels, device=DEV, dtype=dtype, generator=g),
                audio_encoder_hidden_states=torch.randn(1, text, cfg.caption_channels, device=DEV, dtype=dtype,
                                                        generator=g),
                timestep=timestep, audio_timestep=torch.tensor([700.0], device=DEV),
                sigma=torch.tensor([0.7], device=DEV), num_frames=f, height=h, width=w, audio_num_frames=audio)


def offload_layers(model) -> None:
    """A causal LM's decoder layers to host memory, each brought to the device for its call by accelerate's hook (what
    ``device_map`` with layers on "cpu" installs); the embedding, final norm and head stay on the card."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    for layer in model.model.layers:
        weights = {k: v.to("cpu") for k, v in layer.state_dict().items()}
        add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device(DEV), offload=True,
                                                   weights_map=weights, place_submodules=True))
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def offload(model) -> None:
    """The weights to pinned host memory, each block brought back for its call, the next prefetched on a stream."""
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return offload_layers(model)
    from common import send_to_device_without_accelerate
    from diffusers.hooks import apply_group_offloading
    send_to_device_without_accelerate()
    apply_group_offloading(model, onload_device=torch.device(DEV), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=DEV == "cuda")
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def inputs(tokens: int):
    f, h, w = LATENTS.get(tokens, (max(1, tokens // 2048), 64, 128))
    if DEV != "cuda":
        f, h, w = 4, 16, 32
    dtype = BF16 if DEV == "cuda" else torch.float32
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn((1, 16 if DEV == "cuda" else 4, f, h, w), device=DEV, dtype=dtype, generator=g)
    text = torch.randn(1, 512 if DEV == "cuda" else 7, 4096 if DEV == "cuda" else 32, device=DEV, dtype=dtype,
                       generator=g)
    return x, torch.tensor([500], device=DEV), text


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def peak_of(fn):
    return streamplan.measure_peak(fn, device=DEV)


def _h3_out(out):
    return out.sample, out.audio_sample


def _in_fp32(model, call):
    """``call``'s output with the model and every floating tensor its call reads (closure cells, their dicts and
    tuples) in fp32, then each put back in its own dtype (exactly: bf16 -> fp32 -> bf16 loses nothing); the output
    stays fp32."""
    cells = [c for c in (call.__closure__ or ()) if not isinstance(c.cell_contents, torch.nn.Module)]
    held = [c.cell_contents for c in cells]
    cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    tensors = [*model.parameters(), *model.buffers()]
    dtypes = [t.dtype for t in tensors]
    try:
        model.float()
        for c in cells:
            c.cell_contents = torch.utils._pytree.tree_map(cast, c.cell_contents)
        with torch.inference_mode():
            out = call()
    finally:
        for c, v in zip(cells, held):
            c.cell_contents = v
        for t, dt in zip(tensors, dtypes):   # each back in its own dtype (H3 keeps its projections in fp32)
            t.data = t.data.to(dt)
    return out


def _rel(a, b) -> float:
    if isinstance(a, tuple):
        return max(_rel(x, y) for x, y in zip(a, b))
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def refused(model, call, budget: int) -> dict:
    handle = streamplan.apply(model, budget=budget, hidden=HIDDEN)
    before = _allocated()
    t = time.perf_counter()
    try:
        _, peak = peak_of(call)
        row = {"budget_bytes": budget, "error": "accepted (expected a refusal)", "peak_bytes": peak,
               "plans": {k: [p.describe() for p in v] for k, v in handle.plans.items() if v}}
    except streamplan.BudgetError as exc:
        row = {"budget_bytes": budget, "refused": True, "refusal_s": time.perf_counter() - t,
               "smallest_bytes": exc.smallest_bytes, "message": str(exc)[:900],
               "allocated_after_minus_before": _allocated() - before,
               "plans_left": sum(len(p) for p in handle.plans.values())}
    handle.remove()
    return row


REHEARSED = re.compile(r"the whole forward rehearsed in ([0-9.]+) s")


def accepted(model, call, budget: int, ref, stock_s: float, repeat: int = 1, warm=None) -> dict:
    handle = streamplan.apply(model, budget=budget, hidden=HIDDEN)
    gc.collect()
    base = _allocated()
    cap_card(base + budget + CAP_ALLOWANCE)
    row = {"budget_bytes": budget, "budget_GiB": budget / GIB, "cap_bytes": base + budget + CAP_ALLOWANCE}
    try:
        if warm is not None:
            warm()                          # a small call: the capture and the offload hooks' prefetch order
        before = {id(p) for p in handle.plans.get("", [])}
        (out, peak), first_s = timed(lambda: peak_of(call))   # rehearsal + the run
        plan = handle.plans[""][-1]
        said = [m for n in handle.installed[""].runtime_notes if (m := REHEARSED.search(n))]
        found = said[-1] if said and id(plan) not in before else None
        rehearsal_s = float(found.group(1)) if found else 0.0
        times = [first_s - rehearsal_s]
        for _ in range(repeat):
            del out
            (out, peak_again), t = timed(lambda: peak_of(call))
            peak, times = max(peak, peak_again), times + [t]
        t = min(times[1:] or times)
        row.update(root_notes=handle.installed[""].runtime_notes)
        row.update(first_call_s=first_s, rehearsal_s=rehearsal_s, times_s=times, time_s=t, time_vs_stock=t / stock_s,
                   peak_bytes=peak, peak_GiB=peak / GIB, held=peak <= budget, predicted_bytes=plan.predicted_total,
                   rel_diff_vs_stock=_rel(out, ref), tier=str(plan.tier), note=plan.note[:600],
                   **({} if TRUTH is None else {"rel_diff_vs_fp32": _rel(out, TRUTH)}),
                   host_bytes=plan.host_bytes,
                   blocks={k: [p.describe() for p in v] for k, v in handle.plans.items()
                           if k.startswith(("blocks.", "transformer_blocks.", "model.layers."))
                           and v})
        del out
    except streamplan.BudgetError as exc:
        row.update(refused=True, smallest_bytes=exc.smallest_bytes, message=str(exc)[:900])
    except torch.OutOfMemoryError as exc:
        row.update(error=f"out of memory under an accepted budget: {str(exc)[:300]}")
    finally:
        cap_card(None)
        handle.remove()
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> int:
    global DEV, HIDDEN, TRUTH
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan", choices=("wan", "llama", "h3", "ltx2"),
                   help="wan: Wan2.1-14B; llama: Llama-3-8B width, a prefill; h3: MiniMax-H3 (--tokens: packed rows); "
                   "ltx2: LTX-2 image-to-video (--tokens: video rows)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=217088)
    p.add_argument("--budgets-gib", default="7,8,10")
    p.add_argument("--refuse-gib", type=float, default=4.0, help="a budget expected to be refused (0: none)")
    p.add_argument("--stock-once", action="store_true", help="stock timed on its reference call (after a small "
                   "warm-up call) rather than on a second full call: for runs whose stock takes minutes")
    p.add_argument("--run-smallest", action="store_true", help="also run at the refusal's smallest budget (its first "
                   "call timed, the rehearsal taken out)")
    p.add_argument("--offload", action="store_true", help="weights in host memory after stock's reference run: "
                   "diffusers' block-level group offloading with a prefetch stream (pinned); llama: accelerate's hook "
                   "on each decoder layer")
    p.add_argument("--stock-noise", action="store_true", help="stock again under SDPA's memory-efficient kernel: "
                   "its difference from the reference is stock's own noise, beside streamplan's")
    p.add_argument("--stock-fp32", action="store_true", help="stock again with the model and its inputs in fp32 "
                   "(weights cast there and back: bf16 -> fp32 -> bf16 is exact): stock's and each budget's error "
                   "against it, so streamed rounding is set beside stock's own bf16 rounding (twice stock's memory: "
                   "LTX-2 2 layers fit an 80 GB card at 75,600 rows)")
    p.add_argument("--stock-save", default="", help="run stock alone and save its output, time and peak to this "
                   "file (under $OUT when relative), then stop: a reference too long to share one device call with "
                   "the budgets (Llama at 1M tokens, 32 layers)")
    p.add_argument("--stock-from", default="", help="stock's output, time and peak from a --stock-save file (the "
                   "same model, length and seed), instead of running it")
    p.add_argument("--card-budgets-gib", default="", help="with --offload: budgets run first with the weights still "
                   "on the card (one stock run serving both)")
    p.add_argument("--warmup-tokens", type=int, default=8192, help="with --offload: the small first call's length")
    p.add_argument("--repeat", type=int, default=1, help="timed calls after each budget's first")
    p.add_argument("--hidden", default="auto", choices=("auto", "device", "host"),
                   help="apply(hidden=): where the forward keeps its hidden state between blocks")
    p.add_argument("--cpu-dry-run", action="store_true")
    a = p.parse_args()
    if a.stock_from and a.stock_save:
        p.error("--stock-from and --stock-save: one run saves stock's reference, a later one reads it")
    if a.stock_from and not os.path.isfile(a.stock_from):
        p.error(f"--stock-from {a.stock_from!r}: no such file (carry the file --stock-save wrote)")
    HIDDEN = a.hidden
    if a.cpu_dry_run:
        DEV = "cpu"
    faulthandler.dump_traceback_later(900, exit=True)   # a stuck step says where it is
    sys.path.insert(0, os.path.dirname(__file__))
    from common import device_info, write_results
    if a.model == "llama":   # a prefill: no cache, the last position's logits (as generate asks)
        model = build_llama(a.layers)
        g = torch.Generator(device=DEV).manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, a.tokens if DEV == "cuda" else 4096), device=DEV,
                            generator=g)
        call = lambda: model(ids, use_cache=False, logits_to_keep=1).logits  # noqa: E731
    elif a.model == "ltx2":
        model = build_ltx2(a.layers)
        kw = ltx2_inputs(model, a.tokens)
        small_kw = ltx2_inputs(model, a.warmup_tokens if DEV == "cuda" else 200)
        call = lambda: _h3_out(model(**kw))  # noqa: E731
    elif a.model == "h3":
        model = build_h3(a.layers)
        kw = h3_inputs(model, a.tokens if DEV == "cuda" else 400)
        small_kw = h3_inputs(model, a.warmup_tokens if DEV == "cuda" else 200)
        call = lambda: _h3_out(model(**kw))  # noqa: E731
    else:
        model = build(a.layers)
        args = inputs(a.tokens)
        call = lambda: model(*args).sample  # noqa: E731
    rows = []
    where = ("in host memory, each decoder layer brought in by accelerate's AlignDevicesHook" if a.offload and
             a.model == "llama" else "in pinned host memory, block-level group offloading with a prefetch stream"
             if a.offload else "on the card")
    payload = {**(device_info() if DEV == "cuda" else {}),
               "model": (f"LlamaForCausalLM, Llama-3-8B width, {a.layers} layers, a prefill (use_cache=False, "
                         "logits_to_keep=1)" if a.model == "llama" else
                         f"MiniMaxH3Transformer3DModel, real width, {a.layers} layers, 2 refiners, packed text + "
                         "audio + video rows" if a.model == "h3" else
                         f"LTX2VideoTransformer3DModel, real width, {a.layers} layers, per-token timesteps (the "
                         "first latent frame clean), 1024 text tokens" if a.model == "ltx2" else
                         f"WanTransformer3DModel, Wan2.1-14B config, {a.layers} layers") + f", random weights, bf16, "
                        f"weights {where}", "tokens": a.tokens, "allowance_bytes": CAP_ALLOWANCE, "rows": rows,
               "hidden": a.hidden}
    family = {"llama": "llama3_8b", "h3": "minimax_h3", "ltx2": "ltx2"}.get(a.model, "wan14b")
    name = f"gpu_forward_budget_{family}_{a.layers}l_{a.tokens}{'_offload' if a.offload else ''}"

    def keep(row: dict) -> None:   # written after every row: a run cut short keeps what it measured
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("blocks", "plans")}, flush=True)
        if DEV == "cuda":
            write_results(name, payload)

    if a.model in ("h3", "ltx2"):
        warm = lambda: model(**small_kw).sample  # noqa: E731
    elif a.model == "llama":
        warm = lambda: model(ids[:, :a.warmup_tokens], use_cache=False, logits_to_keep=1).logits  # noqa: E731
    else:
        small = inputs(a.warmup_tokens)
        warm = lambda: model(*small).sample  # noqa: E731
    with torch.inference_mode():
        if a.stock_from:   # a reference run in an earlier call (its process gone): what it kept
            held = torch.load(a.stock_from, map_location=DEV)
            same = lambda m: str(m).split(", random weights")[0]  # noqa: E731 -- where the weights live aside
            if (held.get("tokens"), held.get("layers"), same(held.get("model"))) != (a.tokens, a.layers,
                                                                                    same(payload["model"])):
                p.error(f"--stock-from {a.stock_from!r} holds {held.get('model')!r} at {held.get('tokens')} tokens, "
                        f"{held.get('layers')} layers: not this run's")
            ref, stock_peak, stock_s = held["output"], held["peak_bytes"], held["time_s"]
            payload["stock_from"] = {k: v for k, v in held.items() if k != "output"}
        else:
            if a.offload or a.stock_once or a.stock_save:   # stock once at the small size: first-call costs out
                warm()
            (ref, stock_peak), stock_s = timed(lambda: peak_of(call))
            if not (a.offload or a.stock_once or a.stock_save):
                _, stock_s = timed(call)
        if a.stock_save:
            path = os.path.join(os.environ.get("OUT", "."), a.stock_save)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"output": ref, "peak_bytes": stock_peak, "time_s": stock_s, "model": payload["model"],
                        "tokens": a.tokens, "layers": a.layers, "date": time.strftime("%Y-%m-%d"),
                        **(device_info() if DEV == "cuda" else {})}, path)
            print(f"stock: peak {stock_peak / GIB:.2f} GiB above the weights, {stock_s:.1f} s; saved to {path}",
                  flush=True)
            return 0
        payload.update(stock_peak_bytes=stock_peak, stock_time_s=stock_s)
        if a.stock_noise:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:   # (SDPA's memory-efficient kernel takes no grouped K/V heads: Llama's stock has no second kernel)
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if DEV == "cuda" else SDPBackend.MATH):
                    payload["stock_efficient_vs_default_rel_diff"] = _rel(call(), ref)
            except RuntimeError as exc:
                payload["stock_efficient_vs_default_rel_diff"] = f"not run: {str(exc)[:200]}"
            print(f"stock's own noise: {payload['stock_efficient_vs_default_rel_diff']}", flush=True)
        if a.stock_fp32:
            TRUTH = _in_fp32(model, call)
            payload["stock_vs_fp32_rel_diff"] = _rel(ref, TRUTH)
            print(f"stock bf16 against stock fp32: {payload['stock_vs_fp32_rel_diff']}", flush=True)
        print(f"stock: peak {stock_peak / GIB:.2f} GiB above the weights, {stock_s:.1f} s", flush=True)
        scale = GIB if DEV == "cuda" else stock_peak / 8   # the dry run's budgets: eighths of stock's peak
        for budget in [int(float(b) * scale) for b in a.card_budgets_gib.split(",") if b]:
            keep({**accepted(model, call, budget, ref, stock_s, a.repeat), "weights": "on the card"})
        if a.offload:
            offload(model)
        for budget in [int(float(b) * scale) for b in a.budgets_gib.split(",") if b]:
            keep(accepted(model, call, budget, ref, stock_s, a.repeat, warm if a.offload else None))
        if a.refuse_gib > 0:   # last: the smallest's search rehearses several times
            keep(refused(model, call, int(a.refuse_gib * scale)))
        if a.run_smallest and rows[-1].get("smallest_bytes"):   # its first call only
            keep(accepted(model, call, rows[-1]["smallest_bytes"], ref, stock_s, 0, warm if a.offload else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
