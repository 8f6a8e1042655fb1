"""Turn results/latest/suite_*.json into the tables of RESULTS.md (printed) and results/latest/suite.png."""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from streamplan.tools.bench import Row, plot, to_markdown

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    rows, heads = [], set()
    for path in sorted(glob.glob(os.path.join(HERE, "results", "latest", "suite_*.json"))):
        if path.endswith("suite_smoke.json"):
            continue
        data = json.load(open(path))
        heads.add((data["device"], data["torch"], data["date"]))
        rows += data["rows"]
    order = ["wan-14b-block", "flux-double-block", "flux-single-block", "llama3-8b-layer", "wan-14b-model-2-layers",
             "llama3-8b-model-2-layers"]
    rows.sort(key=lambda r: (order.index(r["family"]) if r["family"] in order else 99, r["tokens"]))
    print("Runs:", "; ".join(f"{d}, torch {t}, {day}" for d, t, day in sorted(heads)))
    print(to_markdown([Row(**r) for r in rows]))
    plot(rows, os.path.join(HERE, "results", "latest", "suite.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
