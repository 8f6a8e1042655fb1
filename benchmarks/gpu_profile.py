"""H200: where a streamed block's extra time goes. CUDA kernel time by kernel and by PyTorch op (calls, self CUDA ms,
CPU ms), stock vs streamed, and wall time (median of 5) beside the kernel total, so Python/launch gaps show as wall
minus kernels; the streamed call's enqueue time (until it returns, the GPU not waited for) says whether the host is
what the GPU waits on.

    python benchmarks/gpu_profile.py h3-block:65536:held1.10 ltx-block:217088:16384 llama3-8b-layer:131072:2816/1024
    python benchmarks/gpu_profile.py --memory --tag moe qwen3-moe-layer:131072:held1.15
    python benchmarks/gpu_profile.py --memory --donate --tag moe_donated qwen3-moe-layer:131072:held0.5
    python benchmarks/gpu_profile.py --tag grouped_store hunyuan-double-block:32768:4096/host/g12
(case from ``streamplan.tools.families`` (applied with ``capture="prefer"``, as ``gpu_time_model.py`` applies them) or
gpu_generic.BLOCKS : tokens : mode. The mode is heldF (the planner held to F x the floor) or a fixed chunk C, then
/-fields: S (the MLP in S-feature slices), pN (row pieces), gN (head groups), host (K/V in host memory), qN (its Q
span), bN (its K/V blocks). ``--memory``: the allocations alive at the streamed call's peak (CUDA allocator history),
by the innermost streamplan / library frame that made them, beside the plan's predicted peak: where a memory model's
miss comes from. ``--donate``: each call gets a fresh copy of the block's input, donated, as ``gpu_time_model.py
--donate`` and a model forward hand it. ``--host``: a cProfile of one streamed call, by Python function.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import streamplan
from streamplan.execute.donation import donate
from common import device_info, write_results
from gpu_generic import BF16, BLOCKS
from streamplan.tools.families import FAMILIES


def kernel_table(fn, label: str, rows: int = 14) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Kernel ms by kernel name, and by PyTorch op: [calls, self CUDA ms, CPU ms] (which op launched the time)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = {e.key: [e.count, e.self_device_time_total / 1000, e.self_cpu_time_total / 1000]
           for e in prof.key_averages()}
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time_total / 1000
    print(f"--- {label}: {sum(totals.values()):.1f} ms of kernels, {len(prof.events())} events", flush=True)
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{ms:9.2f} ms  {name}", flush=True)
    return totals, ops


def kind(kernel: str) -> str:
    """A kernel's kind, so the difference reads as GEMMs / attention / copies / the rest."""
    k = kernel.lower()
    if "sdpa" in k or "flash" in k or "fmha" in k or "attention" in k:
        return "attention"
    if "nvjet" in k or "gemm" in k or "cutlass" in k or "cublas" in k:
        return "gemm"
    if "copy" in k or "cat" in k or "memcpy" in k:
        return "copy"
    return "elementwise"


def by_kind(totals: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, ms in totals.items():
        out[kind(name)] = out.get(kind(name), 0.0) + ms
    return out


def wall(fn, repeats: int = 5, wait: bool = True) -> float:
    """Median seconds of ``fn``; ``wait=False``: until it returns, the GPU not waited for (its enqueue time: near the
    wall time, the host is the bottleneck)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return statistics.median(times)


def _case(case: str, n: int) -> tuple[str, torch.nn.Module, tuple, int, dict]:
    """(label, block on the GPU, its call's arguments, floor bytes, apply options) from the families the planner's
    benchmarks share, else from gpu_generic's own blocks."""
    if case in FAMILIES:
        fam = FAMILIES[case]
        with torch.device("cuda"):
            block = fam.build().to(BF16).eval()
        return fam.description, block, fam.inputs(n, torch.device("cuda"), BF16), \
            int(fam.floor_bytes_per_token(BF16) * n), {"capture": "prefer"}
    name, block, inputs, floor = BLOCKS[case](n)
    return name, block.cuda().to(BF16).eval(), inputs(), floor, {}


SITE_FILES = ("streamplan/", "transformers/", "diffusers/", "comfy/")


def _site(frames: list[dict]) -> str:
    """The innermost frame in streamplan or a model library (else the innermost frame): where an allocation was made."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in SITE_FILES) and "torch/" not in name:
            tail = name.split("site-packages/")[-1].split("/tmp/t/")[-1]
            return f"{tail}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "?"


def peak_allocations(fn, prepare, rows: int = 25) -> dict:
    """The allocations alive at ``fn(prepare())``'s allocator peak, by site: bytes above what was allocated before
    ``fn`` ran (what ``prepare`` made, a donated input's fresh copy, not counted, as the timed runs do not count it)."""
    arg = prepare()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        fn(arg)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live, now, best, best_at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            now += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])
        if now > best:
            best, best_at = now, i
    live = {}
    for e in trace[:best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site: dict[str, list[int]] = {}
    for size, site in live.values():
        by_site.setdefault(site, [0, 0])
        by_site[site][0] += size
        by_site[site][1] += 1
    top = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:rows]
    print(f"--- alive at the peak: {best / 2**20:.1f} MiB above the call's start, {len(live)} allocations", flush=True)
    for site, (size, count) in top:
        print(f"{size / 2**20:10.1f} MiB  x{count:<5d} {site}", flush=True)
    return {"peak_bytes": best, "allocations": len(live), "by_site_bytes_count": dict(top)}


MODE_FIELDS = {"p": "row_pieces", "g": "head_groups", "q": "q_span", "b": "kv_block"}


def _mode_options(mode: str, live: int, floor: int) -> dict:
    """apply's options from a spec's mode: ``heldF``, or ``C`` then ``/``-separated fields: a number S (the MLP in
    S-feature slices), pN (row pieces), gN (head groups), host (K/V in host memory), qN (a host store's Q span), bN
    (its K/V block rows)."""
    first, *rest = mode.split("/")
    if first.startswith("held"):
        return {"budget": int(live + float(first[4:]) * floor)}
    opts = {"chunk_tokens": int(first)}
    for field in rest:
        if field == "host":
            opts["kv"] = "host"
        elif field.isdigit():
            opts["ffn_slice"] = int(field)
        elif field[:1] in MODE_FIELDS and field[1:].isdigit():
            opts[MODE_FIELDS[field[:1]]] = int(field[1:])
        else:
            raise ValueError(f"{field!r} in mode {mode!r} is not S, pN, gN, host, qN or bN")
    return opts


def spec_arg(text: str) -> str:
    """argparse type: a ``case:tokens:mode`` spec, checked before anything touches the GPU."""
    fields = text.split(":")
    try:
        if len(fields) != 3:
            raise ValueError("not case:tokens:mode")
        case, n, mode = fields
        if case not in FAMILIES and case not in BLOCKS:
            raise ValueError(f"no case {case!r} (families: {', '.join(FAMILIES)}; gpu_generic: {', '.join(BLOCKS)})")
        if not n.isdigit() or int(n) == 0:
            raise ValueError(f"tokens must be a positive whole number, got {n!r}")
        if mode.startswith("held"):
            float(mode[4:])
        _mode_options(mode, 0, 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def host_profile(fn, rows: int = 30) -> list[list]:
    """Where the host's time goes in one call, by Python function (cProfile, the GPU waited for at the end): what the
    enqueue time is spent on when the host is what the GPU waits on. Rows: [function, calls, own s, cumulative s]."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    out = []
    for (path, line, func), (_, calls, own, cum, _) in stats.items():
        out.append([f"{path.split('site-packages/')[-1].split('/main/')[-1]}:{line} {func}", calls, own, cum])
    by_own = sorted(out, key=lambda r: -r[2])[:rows]
    by_cum = sorted((r for r in out if "streamplan/" in r[0]), key=lambda r: -r[3])[:rows]
    for title, table in (("own time", by_own), ("streamplan's, by cumulative time", by_cum)):
        print(f"--- host, one call: {sum(r[2] for r in out):.3f} s of Python; {title}", flush=True)
        for name, calls, own, cum in table:
            print(f"{own * 1000:9.2f} ms own {cum * 1000:9.2f} ms cum  x{calls:<6d} {name}", flush=True)
    return by_own + [r for r in by_cum if r not in by_own]


def profile_case(spec: str, memory: bool = False, donated: bool = False, host: bool = False) -> dict:
    case, n, mode = spec.split(":")
    n = int(n)
    torch.manual_seed(0)
    name, block, args, floor, apply_opts = _case(case, n)
    live = sum(a.numel() * a.element_size() for a in torch.utils._pytree.tree_leaves(args)
               if isinstance(a, torch.Tensor))
    opts = {**_mode_options(mode, live, floor), **apply_opts}

    # donated: a fresh copy of the input (made outside the memory trace; its copy kernel shows in the kernel tables)
    fresh = (lambda: args[0].clone()) if donated else (lambda: args[0])

    def donated_call(first):
        with donate(*((first,) if donated else ())):
            return block(first, *args[1:])

    def call():
        return donated_call(fresh())
    with torch.inference_mode():
        stock, stock_ops = kernel_table(call, f"{spec} stock")
        stock_wall = wall(call)
        handle = streamplan.apply(block, **opts)
        streamed, streamed_ops = kernel_table(call, f"{spec} streamed")
        streamed_wall = wall(call)
        streamed_enqueue = wall(call, 3, wait=False)
        plan = handle.plans[""][-1]
        print(handle.report(), flush=True)
        at_peak = peak_allocations(donated_call, fresh) if memory else None
        host_rows = host_profile(call) if host else None
        handle.remove()
    diffs = sorted(set(stock) | set(streamed), key=lambda k: -abs(streamed.get(k, 0) - stock.get(k, 0)))[:12]
    print("--- largest differences (streamed - stock), ms", flush=True)
    for k in diffs:
        print(f"{streamed.get(k, 0) - stock.get(k, 0):+9.2f}  {k}", flush=True)
    row = {"spec": spec, "block": name, "input_donated": donated, "tier": str(plan.tier), "chunk": plan.chunk,
           "ffn_slice": plan.ffn_slice,
           "stock_wall_s": stock_wall, "streamed_wall_s": streamed_wall, "time_ratio": streamed_wall / stock_wall,
           "stock_kernel_ms": sum(stock.values()), "streamed_kernel_ms": sum(streamed.values()),
           "streamed_enqueue_s": streamed_enqueue, "predicted_time_ratio": plan.predicted_time_ratio,
           "predicted_peak_bytes": plan.predicted_peak, "live_bytes": live, "floor_bytes": floor,
           "at_peak": at_peak, "host_profile_fn_calls_own_s_cum_s": host_rows,
           "stock_kernel_ms_by_kind": by_kind(stock), "streamed_kernel_ms_by_kind": by_kind(streamed),
           "largest_differences_ms": {k: streamed.get(k, 0) - stock.get(k, 0) for k in diffs}}
    none = [0, 0.0, 0.0]
    by_op = sorted(set(stock_ops) | set(streamed_ops),
                   key=lambda k: -abs(streamed_ops.get(k, none)[1] - stock_ops.get(k, none)[1]))[:25]
    row["ops_stock_vs_streamed_calls_cuda_ms_cpu_ms"] = {k: [stock_ops.get(k, none), streamed_ops.get(k, none)]
                                                         for k in by_op}
    for k in by_op:
        print(f"{k[:60]:60s} stock {stock_ops.get(k, none)}  streamed {streamed_ops.get(k, none)}", flush=True)
    print({k: v for k, v in row.items() if k != "largest_differences_ms"}, flush=True)
    del block, args
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="*", type=spec_arg, default=["h3-block:65536:held1.10"], help="case:tokens:mode")
    p.add_argument("--memory", action="store_true", help="also the allocations alive at the streamed call's peak")
    p.add_argument("--donate", action="store_true", help="hand each call a fresh copy of the block's input, donated")
    p.add_argument("--host", action="store_true", help="also where the host's time goes in a streamed call (cProfile)")
    p.add_argument("--tag", default="", help="written as gpu_profile_<tag>.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles CUDA kernels and the CUDA allocator)")
    info = device_info()
    print(info, flush=True)
    rows = [profile_case(s, a.memory, a.donate, a.host) for s in a.specs]
    print(write_results("gpu_profile" + (f"_{a.tag}" if a.tag else ""), {**info, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
