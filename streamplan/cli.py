"""The ``streamplan`` command."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from .budget import fmt_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamplan", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log planning decisions")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded default model stock and streamed, and compare")
    demo.add_argument("--case", default="wan-block")
    demo.add_argument("--tokens", type=int, default=None)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    demo.add_argument("--budget", default=None, help="bytes, '12GiB', '900MB' or 'auto'")
    demo.add_argument("--chunk-tokens", type=int, default=None)
    demo.add_argument("--ffn-slice", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return {"demo": _demo}[args.command](args)
    except ValueError as exc:
        print(f"streamplan: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
