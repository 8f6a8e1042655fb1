"""H200: whole transformers causal LMs at long context (issue 16), Llama-3-8B width (4096, 32x128 heads, 8 K/V heads,
SwiGLU 14336, vocab 128256), 32 layers, bf16, SDPA, random weights.

prefill: ``model(ids, logits_to_keep=1, use_cache=False)``, stock beside streamplan (its model forward with the
residual donated to every layer, layers from their captured graphs). Peak KB/token above weights and inputs against
the floor (residual + one layer's K + V: 12.0 KB/token), time against stock, the last token's logits against stock's
(and stock's own flash-vs-default difference). Every mode is one run of a few minutes at most; at 1M tokens each mode
alone takes several (one pass of 32 layers' attention over 1M rows), so run them one command each there.

generate: ``generate(max_new_tokens=16)`` greedy with transformers' offloaded cache, stock beside streamplan (the
prefill streams: every layer from its graph, filling the cache from the graph's K/V; decoding steps run stock); tokens,
every step's logits and the first and last layers' cache compared.

Peaked logits: random weights give near-flat logits, whose argmax flips on bf16 noise, so tokens could not be compared.
The model stays a real ``LlamaForCausalLM`` with its own forward; ``peak_logits`` changes weights only: the
embeddings are scaled until each position's own token embedding is ``PEAK_RATIO`` times the rms of what the 32 layers
add to the residual (measured on a short prompt), and the untied head reads a fixed permutation of the embeddings,
so the greedy next token is perm^-1(current) by a wide margin (the JSON has each step's top-1 minus top-2 logit),
while every layer, and attention over the whole cache, still moves every logit (the JSON has each step's relative
difference from stock).

    python benchmarks/gpu_llm.py smoke                            # 2 layers, 8192 tokens, every prefill mode, padded
    python benchmarks/gpu_llm.py prefill 131072                   # stock, chunk 16384, held to 1.15x the floor
    python benchmarks/gpu_llm.py prefill 1048576 stock,held layers=4 stock_layers=32
        # 1M tokens: stock on all 32 layers (its out-of-memory), then streamplan on 4 (32 layers of attention over 1M
        # rows is ~11 min, past one call's limit; with the residual donated the peak does not grow with the layers)
    python benchmarks/gpu_llm.py generate 262144                  # stock and streamplan, offloaded cache

    python benchmarks/gpu_llm.py prefill 131072 stock,held padded=2048   # batch 2, the second left-padded

    python benchmarks/gpu_llm.py prefill 131072 stock,held,chunk=2816/1024,chunk=2816,chunk=8448 layers=4
                                                                  # where a held plan's time goes: its chunk, its slices

Modes: ``stock``; ``chunk`` (16384-row chunks), ``chunk=C`` (C-row chunks), ``chunk=C/S`` (C-row chunks, the MLP in
S-feature slices); ``held`` (the planner given 1.15x the floor); ``held/pN`` (the same with row-local chains, the
RMSNorms' float32 copies among them, run in N pieces of each chunk: larger chunks under the same budget).
Past 256k tokens a streamed mode first runs 8192 tokens
(its layers' capture), then one timed call; every row gives ``time_per_layer_s``.
Optional arguments: ``layers=N`` changes the layer count (default 32); ``stock_layers=K`` runs the stock mode on its
own model of K layers first (its own JSON, ``..._stock<K>l``), the other modes on N; ``padded=P`` runs a batch of 2
whose second sequence has P tokens of left padding (``attention_mask`` zeros: stock builds a [2, 1, N, N] mask;
streamed, each batch element attends its own keys with no mask rows). The floor then counts both sequences. Each
streamed row gives its layers' plans (tier/chunk/MLP slice). ``sdp=flash`` (or ``cudnn``, ``efficient``) runs
everything under ``torch.nn.attention.sdpa_kernel`` with those backends, stock and streamplan alike (streamplan's SDPA
consumer follows the same switches): a causal chunk's past keys differ in length from chunk to chunk, and whether
cuDNN builds a plan per length is what this tells apart. Results:
``$OUT/gpu_llm_<what>_<tokens>[_<modes>][_padded].json``, written after every row.
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamplan
from common import bare_options, cuda_time, device_info, script_parser, timed_peak, write_results
from streamplan.verify import compare_outputs

BF16 = torch.bfloat16
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
FLOOR = (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 2          # bytes per token: residual + K + V, bf16
CHUNK = 16384
DEVICE = "cuda"
GENERATE_CACHE = "offloaded"    # transformers' cache_implementation for generate
PREFILL_MODES = ("stock", "chunk", "held")


PEAK_RATIO = 4.0      # a position's own (scaled) embedding against the rms of what the layers add to the residual
PEAK_LOGIT = 30.0     # the greedy token's logit, about (the others: a few units)


def build(layers: int, peaked: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=layers, vocab_size=VOCAB,
                      max_position_embeddings=1 << 21, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):   # initialised on the card: 8B random weights are slow to make on a CPU
        model = LlamaForCausalLM(cfg).to(BF16).eval()
    model.peaked = peak_logits(model) if peaked else None
    return model


@torch.no_grad()
def peak_logits(model, rounds: int = 3) -> dict:
    """Peaked logits from random weights (see the module's doc): scale the embeddings to ``PEAK_RATIO`` x what the
    layers add (re-measured each round: the layers see the normalised residual, so what they add barely moves), then
    point the head at a permutation of the embeddings. Returns the measured ratio and the head's scale."""
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != emb.data_ptr(), "the head must be untied"
    base = emb.float().clone()
    ids = torch.randint(0, VOCAB, (1, 512), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(7))
    seen: dict = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].float()))
    try:
        scale, ratio = 1.0, 0.0
        for _ in range(rounds):
            model(ids, logits_to_keep=1, use_cache=False)
            own = model.model.embed_tokens(ids).float()
            added = (seen["x"] - own).pow(2).mean().sqrt().item()
            ratio = own.pow(2).mean().sqrt().item() / added
            scale *= PEAK_RATIO / ratio
            emb.copy_(base * scale)
    finally:
        hook.remove()
    # logit of the greedy token ~ |head row| x |normalised residual| x cos = c * rms(E) * HIDDEN * cos
    cos = PEAK_RATIO / (1 + PEAK_RATIO ** 2) ** 0.5
    c = PEAK_LOGIT / (base.pow(2).mean().sqrt().item() * HIDDEN * cos)
    perm = torch.randperm(VOCAB, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3))
    model.lm_head.weight.copy_(base[perm] * c)
    return {"embedding_scale": scale, "ratio_before_last_scaling": ratio, "head_scale": c,
            "rule": "embeddings x scale so own token is PEAK_RATIO x the layers' rms; lm_head = embeddings[perm] x c"}


def _clean() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _logits_summary(logits: torch.Tensor) -> dict:
    last = logits[0, -1].float()
    return {"top5": last.topk(5).indices.tolist(), "head8": [round(v, 4) for v in last[:8].tolist()],
            "norm": last.norm().item()}


class AttentionCalls:
    """How the streamed layers' chunks attended, counted around a call (a benchmark-side spy on the SDPA consumer's
    own module: its fused call with a log-sum-exp, and its ``F``; nothing of torch is patched, so a capture inside the
    call is unaffected): a causal chunk's two parts should both run fused (cuDNN or flash, with their log-sum-exps);
    a refusal, or SDPA called with a mask (its slower kernels), shows here."""

    def __enter__(self) -> collections.Counter:
        from streamplan.attention import sdpa
        self.module, self.fused, self.functional = sdpa, sdpa._fused_with_lse, sdpa.F
        counts = self.counts = collections.Counter()
        real_fused, real_f = self.fused, self.functional

        def fused(q, k, v, causal, scale):
            got = real_fused(q, k, v, causal, scale)
            counts["fused with log-sum-exp" if got is not None else "fused refused"] += 1
            return got

        class Functional:
            def __getattr__(self, name):
                return getattr(real_f, name)

            @staticmethod
            def scaled_dot_product_attention(*args, **kwargs):
                counts["F.sdpa" + (" with a mask" if kwargs.get("attn_mask") is not None else "")] += 1
                return real_f.scaled_dot_product_attention(*args, **kwargs)

        sdpa._fused_with_lse, sdpa.F = fused, Functional()
        return counts

    def __exit__(self, *exc) -> None:
        self.module._fused_with_lse, self.module.F = self.fused, self.functional


def _apply(model, mode: str, inputs: int, n: int):
    if mode == "chunk":
        return streamplan.apply(model, chunk_tokens=CHUNK)
    if mode.startswith("chunk="):   # chunk=C or chunk=C/S (S: the MLP's feature slice)
        c, _, sl = mode[6:].partition("/")
        return streamplan.apply(model, chunk_tokens=int(c), ffn_slice=int(sl) if sl else None)
    if mode == "held" or mode.startswith("held/p"):   # the planner given the inputs plus 1.15x the floor
        pieces = int(mode[6:]) if mode.startswith("held/p") else None   # held/pN: row-local chains in N pieces
        return streamplan.apply(model, budget=int(inputs + 1.15 * FLOOR * n), row_pieces=pieces)
    raise ValueError(f"unknown mode {mode!r}: one of {', '.join(PREFILL_MODES)}, held/pN, chunk=C, chunk=C/S")


def prefill(n: int, layers: int, modes: list[str], name: str, padded: int = 0) -> list[dict]:
    model = build(layers, peaked=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = 2 if padded else 1
    ids = torch.randint(0, VOCAB, (batch, n), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    kw = {}
    if padded:   # the second sequence left-padded, as a tokenizer pads a batch for generation
        mask = torch.ones_like(ids)
        mask[1, :padded] = 0
        kw["attention_mask"] = mask
    call = lambda: model(ids, logits_to_keep=1, use_cache=False, **kw)  # noqa: E731
    repeats = 2 if n <= 262144 else 0     # past 256k tokens one run is minutes: its own time is the time
    base = {"case": f"llama3-8b-width-{layers}-layers", "tokens": n, "layers": layers, "weights_GiB": weights / 2**30,
            "floor_KB_per_token": FLOOR / 1024, "transformers": __import__("transformers").__version__,
            "batch": batch, "left_padding_of_second": padded, "peaked_logits": model.peaked}
    n_all = n * batch            # KB per token and the floor count every sequence's tokens
    kb = lambda b: b / n_all / 1024  # noqa: E731
    rows: list[dict] = []
    ref = None
    stock_t = None

    def emit(row: dict) -> None:
        rows.append({**base, **row})
        print(rows[-1], flush=True)
        write_results(name, {**device_info(), "rows": rows})

    with torch.inference_mode():
        if "stock" in modes:
            _clean()
            try:
                out, peak, t = timed_peak(call, DEVICE)
                ref = out.logits
                del out
                stock_t = cuda_time(call, repeats=repeats, warmup=0) if repeats else t
                noise = None
                if repeats:
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        noise = compare_outputs(call().logits, ref)["output"]["rel"]
                emit({"mode": "stock", "KB_per_token": kb(peak), "peak_vs_floor": peak / FLOOR / n_all,
                      "time_s": stock_t, "time_per_layer_s": stock_t / layers,
                      "stock_flash_vs_default_rel_diff": noise, "logits": _logits_summary(ref)})
            except torch.OutOfMemoryError as exc:
                emit({"mode": "stock", "error": "out of memory", "detail": str(exc)[:400],
                      "max_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30
                      if torch.cuda.is_available() else None})
            _clean()
        for mode in [m for m in modes if m != "stock"]:
            _clean()
            live = ids.numel() * ids.element_size() * (2 if padded else 1)   # the ids (and the mask)
            handle = _apply(model, mode, live, n_all)
            try:
                if not repeats:   # one timed call: the layers' capture first, on a short prompt (rows are symbolic)
                    model(ids[:, :8192], logits_to_keep=1, use_cache=False,
                          **({"attention_mask": kw["attention_mask"][:, :8192]} if padded else {}))
                    _clean()
                start = time.perf_counter()
                with AttentionCalls() as attention_calls:
                    out, peak, t = timed_peak(call, DEVICE)
                first_s = time.perf_counter() - start
                logits = out.logits
                del out
                t = cuda_time(call, repeats=repeats, warmup=0) if repeats else t
                layer_plans = [p for k, ps in handle.plans.items()
                               if k.startswith("model.layers.") and k.count(".") == 2 for p in ps]
                emit({"mode": f"streamplan {mode}", "KB_per_token": kb(peak), "peak_vs_floor": peak / FLOOR / n_all,
                      "time_s": t, "time_per_layer_s": t / layers, "time_ratio": t / stock_t if stock_t else None,
                      "first_call_s_with_capture": first_s, "attention_calls": dict(attention_calls),
                      "rel_diff": compare_outputs(logits, ref)["output"]["rel"] if ref is not None else None,
                      "same_argmax": bool(torch.equal(logits.argmax(-1), ref.argmax(-1))) if ref is not None else None,
                      "logits": _logits_summary(logits),
                      "layer_tiers": sorted({f"{p.tier}/{p.chunk}" + (f"/ffn_slice {p.ffn_slice}" if str(p.tier) == "L2"
                                                                         else "") for p in layer_plans}),
                      # what the first layer was planned in (bytes per token): alive around it, left to it, predicted
                      "layer0_plan_B_per_token": {k: v / n_all for k, v in (
                          ("live", getattr(layer_plans[0], "live_bytes", 0) or 0),
                          ("budget", getattr(layer_plans[0], "budget", 0) or 0),
                          ("predicted_total", layer_plans[0].predicted_total))} if layer_plans else None,
                      "model_forward_notes": [x for k in ("", "model") if k in handle.installed
                                              for x in handle.installed[k].runtime_notes],
                      "report": handle.report()})
                del logits
            except (torch.OutOfMemoryError, streamplan.BudgetError) as exc:
                emit({"mode": f"streamplan {mode}", "error": type(exc).__name__, "detail": str(exc)[:400]})
            finally:
                handle.remove()
    del model
    _clean()
    return rows


def _cache_layers(cache, which: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The K and V of some layers of a finished cache (the offloaded cache keeps them on the host)."""
    return {i: (cache.layers[i].keys, cache.layers[i].values) for i in which}


def _step_logits(out, ref) -> dict:
    """Per generated token: stock's top-1 minus top-2 logit (how peaked) and the streamed logits' relative difference
    (``out``, ``ref``: each step's logits)."""
    margins, diffs = [], []
    for i, b in enumerate(ref):
        top = b[0].float().topk(2).values
        margins.append(round((top[0] - top[1]).item(), 3))
        if out is not None:
            diffs.append(compare_outputs(out[i], b)["output"]["rel"])
    return {"stock_top1_minus_top2": margins, "rel_diff_per_step": diffs or None}


def generate(n: int, layers: int, name: str, new_tokens: int = 16) -> list[dict]:
    model = build(layers, peaked=True)
    ids = torch.randint(0, VOCAB, (1, n), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, cache_implementation=GENERATE_CACHE, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)
    call = lambda: model.generate(ids, **kw)  # noqa: E731
    compared = (0, layers - 1)    # layers whose cache is compared (each is 1 GiB of K and V at 262k tokens)
    base = {"case": f"llama3-8b-width-{layers}-layers generate, {GENERATE_CACHE} cache", "tokens": n, "layers": layers,
            "new_tokens": new_tokens, "floor_KB_per_token": FLOOR / 1024, "peaked_logits": model.peaked,
            "transformers": __import__("transformers").__version__}
    rows: list[dict] = []
    ref_tokens = ref_logits = ref_cache = stock_t = None

    def emit(row: dict) -> None:
        rows.append({**base, **row})
        print(rows[-1], flush=True)
        write_results(name, {**device_info(), "rows": rows})

    def cache_of(out):
        found = getattr(out, "cache", None)
        return found if found is not None else out.past_key_values

    with torch.inference_mode():
        _clean()
        try:
            ref, peak, stock_t = timed_peak(call, DEVICE)
            ref_tokens, ref_logits, ref_cache = ref.sequences, ref.logits, _cache_layers(cache_of(ref), compared)
            del ref   # the other layers' K/V go
            emit({"mode": "stock", "KB_per_token": peak / n / 1024, "time_s": stock_t,
                  "tokens_out": ref_tokens[0, n:].tolist(), **_step_logits(None, ref_logits)})
        except torch.OutOfMemoryError as exc:
            emit({"mode": "stock", "error": "out of memory", "detail": str(exc)[:400]})
        _clean()
        handle = streamplan.apply(model, chunk_tokens=CHUNK)
        try:
            out, peak, t = timed_peak(call, DEVICE)
            row = {"mode": f"streamplan chunk {CHUNK}", "KB_per_token": peak / n / 1024, "time_s": t,
                   "time_ratio": t / stock_t if stock_t else None, "tokens_out": out.sequences[0, n:].tolist()}
            if ref_tokens is not None:
                got = _cache_layers(cache_of(out), compared)
                row.update(same_tokens=bool(torch.equal(out.sequences, ref_tokens)),
                           **_step_logits(out.logits, ref_logits),
                           cache_rel_diff={f"layer {i} {kv}": compare_outputs(
                               got[i][j].to(DEVICE), ref_cache[i][j].to(DEVICE))["output"]["rel"]
                               for i in compared for j, kv in enumerate(("keys", "values"))})
            emit({**row, "report": handle.report()})
        except (torch.OutOfMemoryError, streamplan.BudgetError) as exc:
            emit({"mode": f"streamplan chunk {CHUNK}", "error": type(exc).__name__, "detail": str(exc)[:400]})
        finally:
            handle.remove()
    return rows


def _modes(text: str) -> list[str]:
    """argparse type: comma-separated prefill modes, each ``stock`` or what ``_apply`` takes."""
    modes = text.split(",")
    for mode in modes:
        try:
            if mode.startswith("chunk="):
                c, _, sl = mode[6:].partition("/")
                int(c)
                if sl:
                    int(sl)
            elif mode.startswith("held/p"):
                int(mode[6:])
            elif mode not in PREFILL_MODES:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown mode {mode!r}: one of {', '.join(PREFILL_MODES)}, held/pN, chunk=C, chunk=C/S") from None
    return modes


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("what", nargs="?", default="smoke", choices=("smoke", "prefill", "generate"),
                   help="smoke: 2 layers, every prefill mode, padded, then generate; prefill; generate: greedy with "
                        "the offloaded cache (default: smoke)")
    p.add_argument("tokens", nargs="?", type=int,
                   help="prompt length (default: 8192 for smoke, 131072 for prefill, 262144 for generate)")
    p.add_argument("modes", nargs="?", type=_modes,
                   help="prefill: comma-separated stock, chunk (16384-row chunks), chunk=C, chunk=C/S (the MLP in "
                        "S-feature slices), held (1.15x the floor), held/pN (row-local chains in N pieces); named "
                        "in the results' name when given (default: stock,chunk,held)")
    p.add_argument("--layers", type=int, default=32, help="layer count; also written layers=N (default: %(default)s)")
    p.add_argument("--stock-layers", type=int, metavar="K",
                   help="prefill: stock first on its own model of K layers (its own JSON); also written "
                        "stock_layers=K")
    p.add_argument("--padded", type=int, default=0, metavar="P",
                   help="prefill: a batch of 2, the second with P tokens of left padding; also written padded=P "
                        "(default: %(default)s: batch 1)")
    p.add_argument("--sdp", choices=tuple(SDP_BACKENDS),
                   help="run everything under sdpa_kernel with these backends, stock and streamplan alike; also "
                        "written sdp=NAME (default: PyTorch's choice)")
    a = p.parse_intermixed_args(bare_options(sys.argv[1:], keys=("layers", "padded", "stock_layers", "sdp")))
    if a.sdp is None:
        return run(a)
    with sdpa_kernel(SDP_BACKENDS[a.sdp]):   # stock's calls and streamplan's alike
        return run(a)


SDP_BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION],
                "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION]}


def run(a: argparse.Namespace) -> int:
    layers, stock_layers, padded = a.layers, a.stock_layers, a.padded
    print(device_info(), flush=True)
    what = a.what
    if what == "smoke":
        n = a.tokens if a.tokens is not None else 8192
        prefill(n, min(layers, 2), list(PREFILL_MODES), f"gpu_llm_smoke_{n}")
        prefill(n, min(layers, 2), ["stock", "held"], f"gpu_llm_smoke_{n}_padded{n // 8}", padded=n // 8)
        generate(n, min(layers, 2), f"gpu_llm_smoke_generate_{n}", new_tokens=4)
    elif what == "prefill":
        n = a.tokens if a.tokens is not None else 131072
        modes = a.modes if a.modes is not None else list(PREFILL_MODES)
        tail = f"_padded{padded}" if padded else ""
        if stock_layers is not None and "stock" in modes:   # stock on its own model, first
            prefill(n, stock_layers, ["stock"], f"gpu_llm_prefill_{n}_stock{stock_layers}l{tail}", padded)
            modes = [m for m in modes if m != "stock"]
        suffix = "" if a.modes is None else "_" + "_".join(m.replace("=", "").replace("/", "s") for m in modes)
        if modes:
            prefill(n, layers, modes, f"gpu_llm_prefill_{n}{suffix}" + ("" if layers == 32 else f"_{layers}l") + tail,
                    padded)
    else:   # generate
        n = a.tokens if a.tokens is not None else 262144
        generate(n, layers, f"gpu_llm_generate_{n}" + ("" if layers == 32 else f"_{layers}l"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
