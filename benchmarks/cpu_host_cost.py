"""What a chunk costs the host beyond its work (issue: time under a tight budget): the graph interpreter's per-node
cost, measured where the ops themselves are nearly free. A diffusers Wan block at a tiny width (64 features, 2 heads,
fp32, CPU, one thread) over 2,048 rows, stock against the captured block streamed in chunks of 16 to 256 rows (replay
off), the least of 15 calls each; (streamed - stock) / chunks is what each chunk adds, and divided by the nodes a chunk
runs (both phases), what each node adds. On a GPU the same host time is spent per chunk before the kernels can run
(``op_s`` in the time model, ~10 us a node on the H200's host), so what is saved here is saved there.

    python benchmarks/cpu_host_cost.py        # ~1 min; JSON to $OUT or results/latest/cpu_host_cost.json
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

import streamplan  # noqa: E402
from common import wall_time, write_results  # noqa: E402
from streamplan.graph import streamable  # noqa: E402

ROWS, WIDTH = 2048, 64
CHUNKS = (16, 64, 256)
LEAST_OF = 15   # timed calls per figure, the least taken


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = WanTransformerBlock(WIDTH, 2 * WIDTH, 2, cross_attn_norm=True).eval()
    pos = torch.randn(1, ROWS, 1, WIDTH // 2)
    args = (torch.randn(1, ROWS, WIDTH), torch.randn(1, 16, WIDTH), torch.randn(1, 6, WIDTH), (pos.cos(), pos.sin()))
    rows = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    with torch.inference_mode():
        found, _ = streamable(block, args, {}, ROWS)
        ops = sum(len(p) for p in (*found.phases.kv, found.phases.q))   # the nodes a chunk runs, both phases
        ref = block(*args)
        stock = wall_time(lambda: block(*args), LEAST_OF, min)
        for chunk in CHUNKS:
            handle = streamplan.apply(block, budget=None, chunk_tokens=chunk, replay=False)
            try:
                out = block(*args)
                secs = wall_time(lambda: block(*args), LEAST_OF, min)
            finally:
                handle.remove()
            n = ROWS // chunk
            rows.append({"chunk": chunk, "chunks": n, "stock_s": stock, "streamed_s": secs,
                         "per_chunk_us": (secs - stock) / n * 1e6, "nodes_per_chunk": ops,
                         "per_node_us": (secs - stock) / n / ops * 1e6,
                         "rel_diff": ((out - ref).abs().max() / ref.abs().max()).item()})
            print(rows[-1], flush=True)
    payload = {"device": f"CPU ({platform.processor() or platform.machine()}), 1 thread", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "commit": commit, "rows": ROWS, "width": WIDTH, "results": rows}
    print(write_results("cpu_host_cost", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
