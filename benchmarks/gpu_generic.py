"""H200: blocks streamed from their captured graph (the generic path), real widths, bf16, at long sequences.

For each block: stock (peak KB/token above inputs and weights, time), the captured path at fixed chunks and held by
the planner to 1.15x the floor (residual + K + V), with the block input copied (a lone block) and donated (as a
streamed model forward gives it); output difference to stock beside stock's own flash-vs-default difference (the
hand-written Wan, Flux and Llama block paths measured beside them until they were removed: results/archive/).
The MiniMax-H3 2-layer model at the end: both outputs, stock vs streamed, and under a budget below the floor.

    python benchmarks/gpu_generic.py smoke        # every case at 8192 tokens, one chunk
    python benchmarks/gpu_generic.py blocks 217088
    python benchmarks/gpu_generic.py model 217088
    python benchmarks/gpu_generic.py held 65536 h3-block 1.10   # planner held to 1.10x the floor, one case
    python benchmarks/gpu_generic.py sweep 65536 h3-block 1.10 12672/2048,8448/4096,4224/0/p2
        # input donated: the planner's plan held to 1.10x, each forced chunk/MLP slice[/pN: N row pieces], stock,
        # timed alike (median of 7 on fresh inputs, interleaved rounds in rotating order; a 6th argument: rounds),
        # which fit the floor budget marked; "/f" (MLP split by features), "/nj" (no joins built in place) switch
        # the engine for one variant, "/nf" its element-wise chains not fused (``fuse=False``), "planner/f/nj" the
        # planner's plan under them
"""
from __future__ import annotations

import contextlib
import copy as copy_module
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamplan
from common import cuda_peak, cuda_time, device_info, name_list, script_parser, write_results
from streamplan.execute.donation import donate
from streamplan.verify import compare_outputs

BF16 = torch.bfloat16


def _gen():
    return torch.Generator(device="cuda").manual_seed(1)


def h3_block(n, packed: bool = False):
    """``packed``: the AdaLN index as the model's packed sequence has it, runs of rows of one (timestep, modality):
    512 text rows (index 4), 2000 audio (5), 4096 conditioning video rows at t=0 (0), the noisy video rows (3); else
    one random index per row."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    block = MiniMaxH3TransformerBlock(5376, 56, 128, 14336, 2688, 1e-5, 1e-5)
    pos = torch.randn(n, 96, device="cuda")
    runs = [(4, 512), (5, 2000), (0, 4096)]
    layout = torch.cat([torch.full((k,), i, device="cuda") for i, k in runs]
                       + [torch.full((n - sum(k for _, k in runs),), 3, device="cuda")])

    def inputs():
        g = _gen()
        return (torch.randn(1, n, 5376, device="cuda", dtype=BF16, generator=g),
                torch.randn(2, 2688, device="cuda", generator=g),
                layout if packed else torch.randint(0, 6, (n,), device="cuda", generator=g), (pos.cos(), pos.sin()))
    # floor: the residual (5376 wide) + K + V (56 x 128 = 7168 wide each), bf16
    return "diffusers MiniMaxH3TransformerBlock (5376, 56x128, SwiGLU 14336)", block, inputs, n * (5376 + 2 * 7168) * 2


def hunyuan(single):
    def make(n):
        from diffusers.models.transformers.transformer_hunyuan_video import (
            HunyuanVideoSingleTransformerBlock, HunyuanVideoTransformerBlock)
        cls = HunyuanVideoSingleTransformerBlock if single else HunyuanVideoTransformerBlock
        block = cls(24, 128, 4.0, qk_norm="rms_norm")
        text = 256
        pos = torch.randn(n, 128, device="cuda")

        def inputs():
            g = _gen()
            return (torch.randn(1, n, 3072, device="cuda", dtype=BF16, generator=g),
                    torch.randn(1, text, 3072, device="cuda", dtype=BF16, generator=g),
                    torch.randn(1, 3072, device="cuda", dtype=BF16, generator=g), None, (pos.cos(), pos.sin()))
        name = f"diffusers {cls.__name__} (3072, 24x128, 256 text rows)"
        return name, block, inputs, (n + text) * 3072 * 2 * 3
    return make


def ltx(n):
    from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock
    block = LTXVideoTransformerBlock(2048, 32, 64, cross_attention_dim=2048)
    pos = torch.randn(1, n, 2048, device="cuda")

    def inputs():
        g = _gen()
        return (torch.randn(1, n, 2048, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 128, 2048, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 1, 6 * 2048, device="cuda", dtype=BF16, generator=g), (pos.cos(), pos.sin()))
    return "diffusers LTXVideoTransformerBlock (2048, 32x64, 128 text rows)", block, inputs, n * 2048 * 2 * 3


def wan(n):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    block = WanTransformerBlock(5120, 13824, 40, cross_attn_norm=True)
    pos = torch.randn(1, n, 1, 128, device="cuda")

    def inputs():
        g = _gen()
        return (torch.randn(1, n, 5120, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 512, 5120, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 6, 5120, device="cuda", generator=g), (pos.cos(), pos.sin()))
    return "diffusers WanTransformerBlock (Wan2.1-14B)", block, inputs, n * 5120 * 2 * 3


def flux_single(n):
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
    block = FluxSingleTransformerBlock(3072, 24, 128)
    pos = torch.randn(512 + n, 128, device="cuda")

    def inputs():
        g = _gen()
        return (torch.randn(1, n, 3072, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 512, 3072, device="cuda", dtype=BF16, generator=g),
                torch.randn(1, 3072, device="cuda", dtype=BF16, generator=g), (pos.cos(), pos.sin()))
    return "diffusers FluxSingleTransformerBlock (Flux.1)", block, inputs, (n + 512) * 3072 * 2 * 3


def llama(n):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      attn_implementation="sdpa")
    block = LlamaDecoderLayer(cfg, layer_idx=0)
    pos = torch.randn(1, n, 128, device="cuda")

    def inputs():
        g = _gen()
        return (torch.randn(1, n, 4096, device="cuda", dtype=BF16, generator=g), None, None, None, False,
                (pos.cos().to(BF16), pos.sin().to(BF16)))
    return "transformers LlamaDecoderLayer (Llama-3-8B, GQA 32/8)", block, inputs, n * (4096 + 2 * 1024) * 2


BLOCKS = {"h3-block": h3_block, "h3-block-packed": lambda n: h3_block(n, packed=True),
          "hunyuan-double-block": hunyuan(False), "hunyuan-single-block": hunyuan(True),
          "ltx-block": ltx, "wan-14b-block": wan, "flux-single-block": flux_single, "llama3-8b-layer": llama}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _diff(out, ref) -> float:
    return max(d["rel"] for d in compare_outputs(out, ref).values())


def run_block(case: str, n: int, chunks: list[int], held: bool, hold: float = 1.15) -> list[dict]:
    torch.manual_seed(0)
    name, block, inputs, floor = BLOCKS[case](n)
    block = block.cuda().to(BF16).eval()
    args = inputs()
    base = {"case": case, "block": name, "tokens": n, "floor_KB_per_token": floor / n / 1024}
    rows = []
    kb = lambda b: b / n / 1024  # noqa: E731
    with torch.inference_mode():
        ref, stock_peak = cuda_peak(lambda: block(*args))
        stock_t = cuda_time(lambda: block(*args), repeats=2)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            noise = _diff(block(*args), ref)
        rows.append({**base, "mode": "stock", "KB_per_token": kb(stock_peak), "time_s": stock_t, "time_ratio": 1.0,
                     "stock_flash_vs_default_rel_diff": noise})
        print(rows[-1], flush=True)
        paths = [("captured", "prefer")]
        modes = [(f"chunk {c}", dict(chunk_tokens=c)) for c in chunks]
        if held:
            modes.append((f"planner held to {hold:.2f}x floor", dict(budget=None)))
        for path, capture in paths:
            for label, kw in modes:
                if "budget" in kw:
                    live = sum(a.numel() * a.element_size() for a in torch.utils._pytree.tree_leaves(args)
                               if isinstance(a, torch.Tensor))
                    kw = dict(budget=int(live + hold * floor))
                start = time.perf_counter()
                handle = streamplan.apply(block, capture=capture, **kw)
                try:
                    out, peak = cuda_peak(lambda: block(*args))
                except streamplan.BudgetError as exc:
                    rows.append({**base, "mode": f"{path} {label}", "error": str(exc)[:300]})
                    print(rows[-1], flush=True)
                    handle.remove()
                    continue
                first_s = time.perf_counter() - start
                diff = _diff(out, ref)
                del out
                t = cuda_time(lambda: block(*args), repeats=2)
                plans = handle.plans.get("", [])
                plan = plans[0] if plans else None
                rows.append({**base, "mode": f"{path} {label}", "KB_per_token": kb(peak), "peak_vs_floor": peak / floor,
                             "ffn_slice": plan.ffn_slice if plan else None,
                             "predicted_KB_per_token": kb(plan.predicted_peak) if plan else None,
                             "tier": plan.tier if plan else None, "chunk": plan.chunk if plan else None,
                             "time_s": t, "time_ratio": t / stock_t, "rel_diff": diff,
                             "first_call_s_with_capture": first_s,
                             "notes": [x for e in handle.installed.values() for x in e.runtime_notes]})
                print(rows[-1], flush=True)

                def donated():
                    fresh = inputs()
                    with donate(fresh[0]):
                        return block(*fresh)
                torch.cuda.synchronize()
                fresh_bytes = sum(a.numel() * a.element_size() for a in torch.utils._pytree.tree_leaves(inputs())
                                  if isinstance(a, torch.Tensor))
                torch.cuda.empty_cache()
                out, peak = cuda_peak(donated)
                del out
                peak = max(0, peak - fresh_bytes)
                times = []
                timed = _donated_call(block, inputs)
                for _ in range(3):   # the block call alone: each on fresh inputs (a donated input is overwritten)
                    o, t = timed()
                    times.append(t)
                    del o
                t_don = sorted(times)[1]
                dplan = next((p for p in handle.plans.get("", []) if p is not plan), None)
                rows.append({**base, "mode": f"{path} {label}, input donated", "KB_per_token": kb(peak),
                             "peak_vs_floor": peak / floor, "time_s": t_don, "time_ratio": t_don / stock_t,
                             "tier": dplan.tier if dplan else None, "chunk": dplan.chunk if dplan else None,
                             "ffn_slice": dplan.ffn_slice if dplan else None})
                print(rows[-1], flush=True)
                handle.remove()
    del block, args, ref
    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _engine(flags: set[str]):
    """Engine switches one variant runs under: "f" the MLP split by features (not rows), "nj" no joins built in
    place."""
    from streamplan.graph import schedule, sliced_mlp as mlp
    saved = mlp.SPLIT, schedule.in_place
    mlp.SPLIT = "features" if "f" in flags else "rows"
    if "nj" in flags:   # (what runs in place is kept per capture, which the variants share: filtered per call)
        schedule.in_place = lambda *a: ({}, saved[1](*a)[1])
    try:
        yield
    finally:
        mlp.SPLIT, schedule.in_place = saved


def _donated_call(block, inputs, flags: set[str] = frozenset()):
    def call():
        fresh = inputs()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with donate(fresh[0]), _engine(flags):
            out = block(*fresh)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0
    return call


def run_sweep(case: str, n: int, hold: float, forced: list[str], rounds: int = 7) -> list[dict]:
    """Where a donated block's time goes under a floor budget: every plan installed on its own copy of the block (the
    same weights) and timed in the same rounds (each round runs stock and each plan once, the order rotated round by
    round), so drift and position hit them alike."""
    torch.manual_seed(0)
    name, block, inputs, floor = BLOCKS[case](n)
    block = block.cuda().to(BF16).eval()
    kb = lambda b: b / n / 1024  # noqa: E731
    base = {"case": case, "block": name, "tokens": n, "floor_KB_per_token": floor / n / 1024, "hold": hold}
    live = sum(a.numel() * a.element_size() for a in torch.utils._pytree.tree_leaves(inputs())
               if isinstance(a, torch.Tensor))
    variants = [("planner", dict(budget=int(live + hold * floor)))]
    # "chunk[/ffn_slice][/pN][/f][/nj]": N row pieces (row-local chains in pieces of the chunk); f, nj: engine
    for spec in filter(None, forced):   # switches (``_engine``); "planner/f" the planner's plan under them
        fields = spec.split("/")
        flags = {f for f in fields if f in ("f", "nj")}
        unfused = {"fuse": False} if "nf" in fields else {}
        fields = [f for f in fields if f not in flags and f != "nf"]
        if fields == ["planner"]:
            variants.append((spec, dict(variants[0][1], flags=flags, **unfused)))
            continue
        pieces = int(fields.pop()[1:]) if fields[-1].startswith("p") else 0
        parts = [int(x) for x in fields]
        kw = dict(chunk_tokens=parts[0], ffn_slice=parts[1] if len(parts) > 1 and parts[1] else None, flags=flags,
                  **unfused)
        if pieces:
            kw["row_pieces"] = pieces
        variants.append((spec, kw))
    rows, times, calls = [], {"stock": []}, {}
    with torch.inference_mode():
        fresh = inputs()
        ref, stock_peak = cuda_peak(lambda: block(*fresh))
        stock_peak = max(0, stock_peak)
        for label, kw in list(variants):   # capture, plan, peak, output once each
            copy = copy_module.deepcopy(block)
            flags = kw.get("flags", set())
            handle = streamplan.apply(copy, capture="prefer", **{k: v for k, v in kw.items() if k != "flags"})
            call = calls[label] = _donated_call(copy, inputs, flags)
            try:
                call()
            except streamplan.BudgetError as exc:   # this plan does not fit: the row says so, the others run
                rows.append({**base, "mode": label, "error": str(exc)[:300]})
                variants.remove((label, kw))
                del calls[label], copy
                continue
            fresh_bytes = live
            torch.cuda.empty_cache()
            out, peak = cuda_peak(lambda: call()[0])
            diff = _diff(out, ref)
            del out
            plans = handle.plans.get("", [])
            plan = plans[-1] if plans else None
            rows.append({**base, "mode": label, "donated": True, "KB_per_token": kb(max(0, peak - fresh_bytes)),
                         "peak_vs_floor": max(0, peak - fresh_bytes) / floor, "rel_diff": diff,
                         "tier": plan.tier if plan else None, "chunk": plan.chunk if plan else None,
                         "ffn_slice": plan.ffn_slice if plan else None,
                         "predicted_KB_per_token": kb(plan.predicted_peak) if plan else None,
                         "row_pieces": kw.get("row_pieces", 1)})
            times[label] = []
            print(rows[-1], [n for n in handle.report().splitlines() if "chain" in n], flush=True)
        labels = ["stock", *(label for label, _ in variants)]
        for i in range(rounds):   # each round in another order: no plan always runs right after stock
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                if label == "stock":
                    fresh = inputs()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = block(*fresh)
                    torch.cuda.synchronize()
                    times["stock"].append(time.perf_counter() - t0)
                    del o, fresh
                    continue
                o, t = calls[label]()
                times[label].append(t)
                del o
    stock_t = sorted(times["stock"])[rounds // 2]
    out = [{**base, "mode": "stock", "KB_per_token": kb(stock_peak), "peak_vs_floor": stock_peak / floor,
            "time_s": stock_t, "time_ratio": 1.0, "times_s": times["stock"]}]
    for row in rows:
        if "error" in row:
            out.append(row)
            continue
        t = sorted(times[row["mode"]])[rounds // 2]
        out.append({**row, "time_s": t, "time_ratio": t / stock_t, "times_s": times[row["mode"]],
                    "within_hold": row["peak_vs_floor"] <= hold})
    for row in out:
        print({k: v for k, v in row.items() if k != "times_s"}, flush=True)
    return out


def run_model(n: int, text: int = 512, audio: int = 2000) -> list[dict]:
    """MiniMax-H3 at real width, 2 layers, 217k packed rows: text, audio, video (conditioning rows at t=0)."""
    from diffusers import MiniMaxH3Transformer3DModel
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(num_layers=2, num_refiner_layers=2).cuda().to(BF16).eval()
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        getattr(model, name).float()
    video = n - text - audio
    cond = 4096
    g = _gen()
    idx = torch.arange(n, device="cuda")
    text_i, audio_i, video_i = idx[:text], idx[text:text + audio], idx[text + audio:]
    tags = torch.zeros(n, dtype=torch.long, device="cuda")
    tags[text_i], tags[audio_i] = 1, 2
    ts = torch.ones(n, dtype=torch.long, device="cuda")
    ts[text + audio:text + audio + cond] = 0
    kw = dict(hidden_states=torch.randn(1, video, 96, device="cuda", generator=g),
              audio_hidden_states=torch.randn(1, audio, 32, device="cuda", generator=g),
              encoder_hidden_states=torch.randn(1, text, 5120, device="cuda", dtype=BF16, generator=g),
              timestep=torch.tensor([0.0, 0.6], device="cuda"), timestep_indices=ts, token_tags=tags,
              position_ids=torch.randint(0, 64, (n, 3), device="cuda", generator=g), video_indices=video_i,
              audio_indices=audio_i, text_indices=text_i)
    floor = n * (5376 + 2 * 7168) * 2
    base = {"case": "h3-model-2-layers", "tokens": n, "text_rows": text, "audio_rows": audio,
            "floor_KB_per_token": floor / n / 1024}
    kb = lambda b: b / n / 1024  # noqa: E731
    rows = []
    with torch.inference_mode():
        ref, stock_peak = cuda_peak(lambda: model(**kw))
        stock_t = cuda_time(lambda: model(**kw), repeats=1)
        rows.append({**base, "mode": "stock", "KB_per_token": kb(stock_peak), "time_s": stock_t})
        print(rows[-1], flush=True)
        live = sum(t.numel() * t.element_size() for t in kw.values())
        for label, opts in (("chunk 16384", dict(chunk_tokens=16384)),
                            ("planner held to 1.15x floor", dict(budget=int(live + 1.15 * floor))),
                            ("budget 0.8x floor", dict(budget=int(live + 0.8 * floor)))):
            handle = streamplan.apply(model, **opts)
            try:
                out, peak = cuda_peak(lambda: model(**kw))
            except streamplan.BudgetError as exc:
                rows.append({**base, "mode": label, "error": str(exc)[:400]})
                print(rows[-1], flush=True)
                handle.remove()
                continue
            d_video = compare_outputs(out.sample, ref.sample)["output"]["rel"]
            d_audio = compare_outputs(out.audio_sample, ref.audio_sample)["output"]["rel"]
            del out
            t = cuda_time(lambda: model(**kw), repeats=1)
            plan = handle.plans["transformer_blocks.0"][0]
            rows.append({**base, "mode": label, "KB_per_token": kb(peak), "peak_vs_floor": peak / floor,
                         "time_s": t, "time_ratio": t / stock_t, "rel_diff_video": d_video, "rel_diff_audio": d_audio,
                         "block_tier": plan.tier, "block_chunk": plan.chunk})
            print(rows[-1], flush=True)
            handle.remove()
    return rows


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("what", nargs="?", default="smoke", choices=("smoke", "blocks", "model", "held", "sweep"),
                   help="smoke: each case at one 2048-row chunk, then the MiniMax-H3 model; blocks: each case at "
                        "16384-row chunks and held to 1.15x the floor; held: each case held to HOLD floors; sweep: "
                        "the first case, the planner's plan and VARIANTS timed alike; model: the MiniMax-H3 2-layer "
                        "model (default: %(default)s)")
    p.add_argument("tokens", nargs="?", type=int, default=8192, help="sequence length (default: %(default)s)")
    p.add_argument("cases", nargs="?", type=name_list(BLOCKS), default=",".join(BLOCKS),
                   help="comma-separated blocks (sweep: the first; model: unused); default: all of them")
    p.add_argument("hold", nargs="?", type=float, default=1.15,
                   help="held, sweep: the planner's budget, this many floors (default: %(default)s)")
    p.add_argument("variants", nargs="?",
                   help="sweep: comma-separated forced plans, chunk/MLP slice[/pN][/f][/nj][/nf] or planner[/...] "
                        "(default: none)")
    p.add_argument("rounds", nargs="?", type=int, default=7, help="sweep: timed rounds (default: %(default)s)")
    a = p.parse_args()
    what, n, cases, hold = a.what, a.tokens, a.cases, a.hold   # hold: the planner's budget, this many floors
    info = device_info()
    print(info, flush=True)
    rows: list[dict] = []
    if what == "smoke":
        for case in cases:
            rows += run_block(case, n, [2048], held=False)
        rows += run_model(max(n, 8192), text=512, audio=400)
    elif what == "blocks":
        for case in cases:
            rows += run_block(case, n, [16384], held=True)
            write_results(f"gpu_generic_{what}_{n}", {**info, "rows": rows})
    elif what == "held":       # the planner held to 1.15x the floor, captured path only
        for case in cases:
            rows += run_block(case, n, [], held=True, hold=hold)
            write_results(f"gpu_generic_{what}_{n}", {**info, "rows": rows})
    elif what == "sweep":
        rows += run_sweep(cases[0], n, hold, a.variants.split(",") if a.variants is not None else [], a.rounds)
    elif what == "model":
        rows += run_model(n)
    suffix = f"_{hold:.2f}" if what in ("held", "sweep") else ""
    print(write_results(f"gpu_generic_{what}_{n}{suffix}", {**info, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
