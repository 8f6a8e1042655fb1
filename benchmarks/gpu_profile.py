"""H200: where a streamed block's extra time goes. CUDA kernel time by kernel, stock vs streamed, one call each."""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import streamplan
from streamplan.families import FAMILIES


def kernel_table(fn, label: str, rows: int = 18) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time_total / 1000
    print(f"--- {label}: {sum(totals.values()):.1f} ms of kernels, {len(prof.events())} events")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{ms:9.2f} ms  {name}")
    return totals


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "wan-14b-block"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    fam = FAMILIES[name]
    with torch.device("cuda"):
        block = fam.build().to(torch.bfloat16).eval()
    args = fam.inputs(tokens, torch.device("cuda"), torch.bfloat16)
    with torch.inference_mode():
        stock = kernel_table(lambda: block(*args), f"{name} stock")
        handle = streamplan.apply(block, chunk_tokens=4096)
        streamed = kernel_table(lambda: block(*args), f"{name} streamed 4096")
        handle.remove()
    print("--- largest differences (streamed - stock), ms")
    for k in sorted(set(stock) | set(streamed), key=lambda k: -abs(streamed.get(k, 0) - stock.get(k, 0)))[:12]:
        print(f"{streamed.get(k, 0) - stock.get(k, 0):+9.2f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
