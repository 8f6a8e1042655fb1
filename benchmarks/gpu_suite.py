"""One GPU run of the suite: stock, peers and streamplan per family and token count (see streamplan/tools/bench.py).

    python gpu_suite.py --cases wan-14b-block,flux-single-block --tokens 32768,131072 --tag blocks

Writes suite_<tag>.json under $OUT (or results/latest/). `render.py` turns the JSON files into RESULTS tables and a
plot.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from streamplan.tools.bench import CASES, header, run_case, to_markdown

DEFAULT_MODES = "stock,naive-chunked-ffn,forward-chunking,streamplan-4096,streamplan-16384,streamplan-24GiB"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--tokens", default="32768,65536,131072,217088")
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="all")
    a = p.parse_args()
    rows = []
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results", "latest")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"suite_{a.tag}.json")
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for name in a.cases.split(","):
        for row in run_case(CASES[name](), [int(t) for t in a.tokens.split(",")], a.modes.split(","), a.repeats):
            if alloc:
                row.mode = f"{row.mode} ({alloc})"
            rows.append(row)
            print(to_markdown([row]).splitlines()[-1], flush=True)
            with open(path, "w") as f:   # rewritten after every row: a run cut short keeps what it measured
                json.dump({**header(), "alloc_conf": alloc, "rows": [r.__dict__ for r in rows]}, f, indent=1)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
