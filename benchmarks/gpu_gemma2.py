"""H200: Gemma 2 at long context (issue 16's soft-capping), Gemma-2-9B width (3584, 16 query heads x 256, 8 K/V heads,
GeGLU 14336, vocab 256000, alternating 4096-token sliding and full layers, attention logits soft-capped at 50, final
logits at 30), bf16, random weights, transformers' eager attention (the only one it gives Gemma 2 here).

Stock eager builds the [1, 1, N, N] mask and every layer's [1, 16, N, N] scores (and their fp32 softmax); streamplan
finds the hand-written attention in each layer's graph and streams it, soft-capping in bounded pieces of scores, its
masks built per Q chunk (none on full layers). Prefill ``model(ids, logits_to_keep=1, use_cache=False)``: peak
KB/token above weights and inputs against the floor (residual + one layer's K + V: 15.0 KB/token), time against
stock where stock fits, the last token's logits against stock's.

    python benchmarks/gpu_gemma2.py 16384 stock,chunk=4096,held layers=4
    python benchmarks/gpu_gemma2.py 131072 held layers=2          # stock: [16, N, N] scores do not fit
    python benchmarks/gpu_gemma2.py 131072 held layers=2 stages   # + CUDA peaks per stage (embedding, rope, each layer)
    python benchmarks/gpu_gemma2.py dry                           # CPU, tiny widths: the script itself
Modes: ``stock``; ``chunk=C`` (C-row chunks); ``held`` (the planner given ``hold=`` times the floor, 1.15 by default:
the position embeddings (1 KB/token at head_dim 256) and the soft-capped scores' pieces (~144 MiB) come out of it).
Results: ``$OUT/gpu_gemma2_<tokens>_<layers>l.json``, written after every row.
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

import streamplan
from common import bare_options, cuda_time, device_info, int_or, script_parser, stage_peaks, timed_peak, write_results
from streamplan.verify import compare_outputs

REAL = dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
            vocab_size=256000, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, sliding_window=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def build(widths: dict, layers: int, device: str, dtype: torch.dtype):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(**widths, num_hidden_layers=layers, max_position_embeddings=1 << 21,
                       attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        return Gemma2ForCausalLM(cfg).to(dtype).eval()


def _modes(text: str) -> list[str]:
    """argparse type: comma-separated modes, each ``stock``, ``chunk=C`` or ``held``."""
    modes = text.split(",")
    for mode in modes:
        try:
            if mode.startswith("chunk="):
                int(mode[6:])
            elif mode not in ("stock", "held"):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"unknown mode {mode!r}: stock, chunk=C or held") from None
    return modes


def main(argv: list[str]) -> int:
    p = script_parser(__doc__)
    p.add_argument("tokens", type=int_or("dry"), metavar="{TOKENS,dry}",
                   help="prompt length; dry: CPU, tiny widths, 512 tokens, modes stock,chunk=128,held")
    p.add_argument("modes", nargs="?", type=_modes,
                   help="comma-separated: stock, chunk=C (C-row chunks), held (the planner given HOLD floors); "
                        "required unless dry (which ignores it)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers; also written layers=N (default: %(default)s)")
    p.add_argument("--hold", type=float, default=1.15,
                   help="held's budget in floors, above the inputs; also written hold=F (default: %(default)s)")
    p.add_argument("--stages", action="store_true",
                   help="also CUDA peaks per stage (embedding, rope, each layer) of each streamed mode; also written "
                        "stages")
    a = p.parse_intermixed_args(bare_options(argv[1:], keys=("layers", "hold"), flags=("stages",)))
    dry = a.tokens == "dry"
    if not dry and a.modes is None:
        p.error("the following arguments are required: modes (unless dry)")
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    n = 512 if dry else a.tokens
    modes = ["stock", "chunk=128", "held"] if dry else a.modes
    layers, hold = a.layers, a.hold
    widths = TINY if dry else REAL
    floor = (widths["hidden_size"] + 2 * widths["num_key_value_heads"] * widths["head_dim"]) * dtype.itemsize
    model = build(widths, layers, device, dtype)
    gen = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, widths["vocab_size"], (1, n), device=device, generator=gen)
    call = lambda: model(ids, logits_to_keep=1, use_cache=False).logits  # noqa: E731
    info = {"device": "cpu (dry run, tiny widths)"} if dry else device_info()
    base = {"case": f"gemma2-9b-width-{layers}-layers" if not dry else "gemma2-tiny", "tokens": n, "layers": layers,
            "floor_KB_per_token": floor / 1024, "transformers": __import__("transformers").__version__}
    rows, ref, stock_t = [], None, None
    name = f"gpu_gemma2_{'dry' if dry else n}_{layers}l"

    def emit(row: dict) -> None:
        rows.append({**base, **row})
        print(rows[-1], flush=True)
        if not dry:
            write_results(name, {**info, "rows": rows})

    with torch.inference_mode():
        for mode in modes:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            handle = None
            try:
                if mode == "held":
                    handle = streamplan.apply(model, budget=int(ids.numel() * 8 + hold * floor * n))
                elif mode.startswith("chunk="):
                    handle = streamplan.apply(model, chunk_tokens=int(mode[6:]))
                elif mode != "stock":
                    raise ValueError(f"unknown mode {mode!r}: stock, chunk=C or held")
                logits, peak, first = timed_peak(call, device)
                t = cuda_time(call, repeats=2, warmup=0) if device == "cuda" else first
                row = {"mode": mode if mode != "held" else f"held {hold}x", "KB_per_token": peak / n / 1024,
                       "peak_vs_floor": peak / floor / n, "time_s": t,
                       "time_per_layer_s": t / layers}
                if mode == "stock":
                    ref, stock_t = logits, t
                else:
                    layer_plans = [p for k, ps in handle.plans.items() if k.startswith("model.layers.") for p in ps]
                    row.update(time_ratio=t / stock_t if stock_t else None, first_call_s_with_capture=first,
                               rel_diff=compare_outputs(logits, ref)["output"]["rel"] if ref is not None else None,
                               layer_plans=sorted({f"{p.tier}/{p.chunk}" for p in layer_plans}),
                               ran_stock={k: sorted({x for x in e.runtime_notes if "stock" in x})
                                          for k, e in handle.installed.items()
                                          if any("ran stock" in x for x in e.runtime_notes)})
                if a.stages and device == "cuda" and mode != "stock":   # where the peak is, stage by stage
                    with stage_peaks(modules=[("embed_tokens", model.model.embed_tokens)]) as probe:
                        call()
                    row["stages"] = probe.rows
                emit(row)
            except (torch.OutOfMemoryError, streamplan.BudgetError) as exc:
                emit({"mode": mode, "error": type(exc).__name__, "detail": str(exc)[:300],
                      "report": handle.report() if handle is not None else None})
            finally:
                if handle is not None:
                    handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
