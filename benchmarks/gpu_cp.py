"""streamplan inside diffusers' context parallelism (Ulysses) on 2 GPUs of one host (issue 15).

    torchrun --nproc_per_node=2 benchmarks/gpu_cp.py [--tokens 217088,434176] [--chunk 16384] [--repeats 2]

A ``WanTransformer3DModel`` at Wan2.1-14B width with 2 layers, bf16, random weights (the same on both ranks), on a
1024x1024-pixel latent (128x128, 2x2 patches: 4,096 tokens a frame), 53 and 106 frames: 217,088 and 434,176 tokens.
Rank 0 first measures one GPU alone (stock, and streamplan at ``--chunk`` rows and held by the planner to 1.15x the
floor) while rank 1 waits; then both ranks run diffusers' context parallelism (``ContextParallelConfig(
ulysses_degree=2)``): stock, then streamplan (the same two settings; held: 1.15x each rank's share of the floor).
Per-rank peak activation memory (CUDA allocator, above weights and inputs) is reported per *global* token: the
floor (residual + K + V, 30 KB a token at this width) split over 2 ranks is 15 KB. Times are the slower rank's,
median of ``--repeats`` after one warm-up call; outputs compared with one GPU's stock output. Results:
``benchmarks/results/latest/gpu_cp_<tokens>.json`` (or ``$OUT``).

``--smoke`` runs the same steps on CPU (gloo) with a tiny model, to check the script, not to measure:
``torchrun --nproc_per_node=2 benchmarks/gpu_cp.py --smoke``."""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_peak, cuda_time, device_info, rel_diff, wall_time, write_results  # noqa: E402

import streamplan  # noqa: E402


class Setup:
    """The model's width and where it runs: Wan2.1-14B width in bf16 on CUDA, or (``--smoke``) tiny, fp32, CPU."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.width, self.heads, self.ffn, self.text_dim = (64, 4, 256, 32) if smoke else (5120, 40, 13824, 4096)
        self.latent = 16 if smoke else 128             # 1024x1024 pixels after an 8x VAE
        self.tokens_per_frame = (self.latent // 2) ** 2  # 2x2 patches
        self.floor_bytes_per_token = 3 * self.width * self.dtype.itemsize   # residual + K + V

    def peak(self, fn):
        return streamplan.measure_peak(fn, device=self.device) if self.smoke else cuda_peak(fn)

    def time(self, fn, repeats: int) -> float:
        return cuda_time(fn, repeats=repeats) if not self.smoke else wall_time(fn, repeats)


S: Setup = None   # set in main


def _model():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    with S.device:
        model = WanTransformer3DModel(num_layers=2, text_dim=S.text_dim, in_channels=16, out_channels=16,
                                      ffn_dim=S.ffn, num_attention_heads=S.heads,
                                      attention_head_dim=S.width // S.heads, freq_dim=32 if S.smoke else 256)
    return model.to(S.dtype).eval()


def _inputs(n: int) -> dict:
    if n % S.tokens_per_frame:
        raise SystemExit(f"--tokens must be a multiple of {S.tokens_per_frame} (one {S.latent}x{S.latent} latent "
                         "frame)")
    g = torch.Generator(device=S.device).manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, n // S.tokens_per_frame, S.latent, S.latent, device=S.device,
                                          dtype=S.dtype, generator=g),
                timestep=torch.tensor([500], device=S.device),
                encoder_hidden_states=torch.randn(1, 512, S.text_dim, device=S.device, dtype=S.dtype, generator=g),
                return_dict=False)


def _live(kw: dict) -> int:
    return sum(v.numel() * v.element_size() for v in kw.values() if isinstance(v, torch.Tensor))


def _slowest(x: float) -> float:
    t = torch.tensor([x], device=S.device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _per_rank(x: int) -> list[int]:
    found = [torch.zeros(1, dtype=torch.int64, device=S.device) for _ in range(dist.get_world_size())]
    dist.all_gather(found, torch.tensor([x], dtype=torch.int64, device=S.device))
    return [int(t.item()) for t in found]


def _settings(chunk: int, floor_share: int, live: int) -> list[tuple[str, dict]]:
    return [(f"chunk {chunk}", dict(chunk_tokens=chunk)),
            ("planner held to 1.15x floor", dict(budget=int(live + 1.15 * floor_share)))]


def _block_plans(handle) -> dict:
    return {k: [p.describe() for p in v] for k, v in handle.plans.items() if k.startswith("blocks.")}


def one_gpu(model, kw: dict, n: int, chunk: int, repeats: int) -> tuple[list[dict], torch.Tensor]:
    """Rank 0 alone, no parallelism: stock and streamed."""
    floor = n * S.floor_bytes_per_token
    kb = lambda b: b / n / 1024  # noqa: E731
    base = {"tokens": n, "gpus": 1, "floor_KB_per_token": kb(floor)}
    rows = []
    with torch.inference_mode():
        ref, peak = S.peak(lambda: model(**kw)[0])
        t_stock = S.time(lambda: model(**kw), repeats)
        rows.append({**base, "mode": "stock", "KB_per_token": kb(peak), "time_s": t_stock})
        print(rows[-1], flush=True)
        for label, opts in _settings(chunk, floor, _live(kw)):
            handle = streamplan.apply(model, **opts)
            try:
                out, peak = S.peak(lambda: model(**kw)[0])
            except streamplan.BudgetError as exc:
                rows.append({**base, "mode": f"streamplan, {label}", "error": str(exc)[:400]})
                print(rows[-1], flush=True)
                handle.remove()
                continue
            diff = rel_diff(out, ref)
            del out
            t = S.time(lambda: model(**kw), repeats)
            rows.append({**base, "mode": f"streamplan, {label}", "KB_per_token": kb(peak), "peak_vs_floor":
                         peak / floor, "time_s": t, "time_vs_stock": t / t_stock, "rel_diff_vs_stock": diff,
                         "plans": _block_plans(handle)})
            print(rows[-1], flush=True)
            handle.remove()
    return rows, ref


def context_parallel(model, kw: dict, n: int, chunk: int, repeats: int, ref: torch.Tensor | None) -> list[dict]:
    """Both ranks, diffusers' Ulysses (enabled by the caller): stock, then streamed."""
    world = dist.get_world_size()
    share = n * S.floor_bytes_per_token // world
    kb = lambda b: b / n / 1024  # noqa: E731
    base = {"tokens": n, "gpus": world, "floor_KB_per_token": kb(n * S.floor_bytes_per_token),
            "floor_share_KB_per_global_token": kb(share)}
    rank0 = dist.get_rank() == 0
    rows = []

    def measured(label: str, extra: dict, t_stock: float | None) -> float:
        out, peak = S.peak(lambda: model(**kw)[0])
        diff = rel_diff(out, ref) if rank0 and ref is not None else None
        del out
        t = _slowest(S.time(lambda: model(**kw), repeats))
        peaks = _per_rank(peak)
        row = {**base, "mode": label, "KB_per_global_token_per_rank": [kb(p) for p in peaks],
               "worst_rank_vs_floor_share": max(peaks) / share, "time_s": t, **extra}
        if t_stock is not None:
            row["time_vs_cp_stock"] = t / t_stock
        if diff is not None:
            row["rel_diff_vs_one_gpu_stock"] = diff
        rows.append(row)
        if rank0:
            print(row, flush=True)
        return t

    with torch.no_grad():
        t_stock = measured("diffusers CP stock (Ulysses)", {}, None)
        for label, opts in _settings(chunk, share, _live(kw)):
            handle = streamplan.apply(model, **opts)
            start = time.perf_counter()
            try:   # every rank plans with the same (smallest) budget: all raise, or none
                model(**kw)   # captures the block class once, plans each block (agreed across ranks)
            except streamplan.BudgetError as exc:
                rows.append({**base, "mode": f"CP + streamplan, {label}", "error": str(exc)[:400]})
                if rank0:
                    print(rows[-1], flush=True)
                handle.remove()
                continue
            first = time.perf_counter() - start
            measured(f"CP + streamplan, {label}", {"first_call_s": first, "plans": _block_plans(handle),
                                                   "report": handle.report() if rank0 else None}, t_stock)
            handle.remove()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="217088,434176")
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-one-gpu", action="store_true", help="only the context-parallel runs")
    ap.add_argument("--smoke", action="store_true", help="CPU (gloo), tiny model: checks the script, measures nothing")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node=2 benchmarks/gpu_cp.py")
    global S
    S = Setup(args.smoke)
    # one-GPU runs on rank 0 take minutes at 434k tokens while rank 1 waits at a barrier
    timeout = datetime.timedelta(minutes=60)
    if args.smoke:
        torch.accelerator.device_count = lambda: 1   # diffusers picks rank % device_count: one "device", the CPU
        dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(S.device)
        dist.init_process_group("nccl", timeout=timeout, device_id=S.device)
    rank = dist.get_rank()
    from diffusers import ContextParallelConfig
    info = {} if rank or args.smoke else device_info()
    tokens = "2048,4096" if args.smoke and args.tokens == ap.get_default("tokens") else args.tokens
    if args.smoke and args.chunk == ap.get_default("chunk"):
        args.chunk = 256
    for n in (int(t) for t in tokens.split(",")):
        kw = _inputs(n)
        model = _model()
        rows, ref = [], None
        if rank == 0 and not args.skip_one_gpu:
            rows, ref = one_gpu(model, kw, n, args.chunk, args.repeats)
        dist.barrier()
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
        rows += context_parallel(model, kw, n, args.chunk, args.repeats, ref)
        if rank == 0 and not args.smoke:
            print(write_results(f"gpu_cp_{n}", {**info, "model": "WanTransformer3DModel, Wan2.1-14B width, 2 layers",
                                                 "world": dist.get_world_size(), "rows": rows}), flush=True)
        del model, kw, ref
        if not args.smoke:
            torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
