"""The ``streamplan`` command."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from .budget import fmt_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _family_names() -> list[str]:
    from .families import FAMILIES
    return list(FAMILIES)


def _demo(args: argparse.Namespace) -> int:
    from .demo import CASES, run_demo

    if args.case not in CASES:
        print(f"unknown case {args.case!r}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    print(f"streamplan demo: {args.case}, stock then streamed ...", flush=True)
    r = run_demo(args.case, tokens=args.tokens, device=args.device, dtype=DTYPES[args.dtype], budget=args.budget,
                 chunk_tokens=args.chunk_tokens, ffn_slice=args.ffn_slice)
    print(r.report)
    print(f"\n{r.case}: {r.tokens} tokens, {r.dtype} on {r.device}")
    print(f"  stock peak     {fmt_bytes(r.stock_peak):>12}")
    print(f"  streamed peak  {fmt_bytes(r.streamed_peak):>12}   ({r.streamed_peak / r.stock_peak:.1%} of stock)")
    print(f"  max relative difference to stock: {r.max_rel_diff:.2e}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import streamplan
    from .families import FAMILIES, on_meta

    family = FAMILIES.get(args.family)
    if family is None:
        print(f"unknown family {args.family!r}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    module, inputs = on_meta(family, args.tokens, dtype)      # nothing is allocated: shapes only
    handle = streamplan.apply(module, budget=args.budget, chunk_tokens=args.chunk_tokens)
    with torch.inference_mode():
        module(*inputs)
    if args.json:
        print(handle.to_json())
        return 0
    print(f"{family.description}\n{args.tokens} tokens, {args.dtype}, budget {args.budget or 'none (default chunks)'}"
          f" -- planned on meta tensors, nothing run\n")
    print(handle.report())
    plans = [p for ps in handle.plans.values() for p in ps]
    floor = family.floor_bytes_per_token(dtype)
    if plans:
        plan = max(plans, key=lambda p: p.predicted_total)
        kb = lambda b: b / args.tokens / 1024  # noqa: E731
        print(f"\npredicted KB/token above the inputs: stock {kb(plan.stock_peak):.1f}, planned "
              f"{kb(plan.predicted_peak):.1f}; floor (residual + K + V) {kb(floor * args.tokens):.1f}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json
    import os

    if not torch.cuda.is_available():
        print("streamplan bench measures with the CUDA allocator and CUDA events: it needs a CUDA GPU "
              "(use `streamplan plan` to see plans without one)", file=sys.stderr)
        return 2
    from .bench import CASES, as_dicts, header, plot, run_case, to_markdown

    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = args.modes.split(",")
    rows = []
    total = len(cases) * len(tokens) * len(modes)
    print(to_markdown([]), flush=True)
    for name in cases:
        for row in run_case(CASES[name](), tokens, modes, args.repeats):
            rows.append(row)
            print(f"{to_markdown([row]).splitlines()[-1]}   [{len(rows)}/{total}]", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({**header(), "rows": as_dicts(rows)}, f, indent=1)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(to_markdown(rows) + "\n")
    try:
        plot(as_dicts(rows), os.path.join(args.out, "bench.png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'streamplan[bench]')", file=sys.stderr)
    print(f"results in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamplan", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log planning decisions")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded default model stock and streamed, and compare")
    demo.add_argument("--case", default="wan-block")
    demo.add_argument("--tokens", type=int, default=None)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    demo.add_argument("--budget", default=None, help="bytes, '12GiB', '900MB' or 'auto' (default: fixed chunks, so "
                      "that the demo streams)")
    demo.add_argument("--chunk-tokens", type=int, default=None)
    demo.add_argument("--ffn-slice", type=int, default=None)
    plan = sub.add_parser("plan", help="print the plan for a model family at a token count and budget (runs nothing)")
    plan.add_argument("--family", default="wan-14b-block", help="one of: " + ", ".join(_family_names()))
    plan.add_argument("--tokens", type=int, default=65536)
    plan.add_argument("--budget", default=None, help="bytes, '12GiB', '900MB'")
    plan.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    plan.add_argument("--chunk-tokens", type=int, default=None)
    plan.add_argument("--json", action="store_true", help="the plans as JSON")
    bench = sub.add_parser("bench", help="stock, peers and streamplan on your GPU (JSON, Markdown, plot)")
    bench.add_argument("--cases", default="wan-14b-block,flux-single-block",
                       help="comma-separated: wan-14b-block, flux-double-block, flux-single-block, llama3-8b-layer, "
                            "wan-14b-model-2-layers, llama3-8b-model-2-layers")
    bench.add_argument("--tokens", default="32768,65536,131072")
    bench.add_argument("--modes", default="stock,naive-chunked-ffn,streamplan-4096,streamplan-16384")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--out", default="streamplan-bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return {"demo": _demo, "plan": _plan, "bench": _bench}[args.command](args)
    except ValueError as exc:  # BudgetError included: the smallest reachable peak is in its message
        print(f"streamplan: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
