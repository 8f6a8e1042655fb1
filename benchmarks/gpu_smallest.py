"""H200: the smallest budget a block is told holds on the device. For each block at a length, ``apply(budget=1)`` is
refused with ``BudgetError.smallest_bytes``; each refusal's figure is taken as the next budget until one runs. That
run is measured with the CUDA allocator (the call's peak above what was allocated before it, plus its live inputs,
against the budget), timed against stock in the same process (median of 2 after a warm-up), and its output compared
with stock's beside stock's own flash-vs-default difference.

    python benchmarks/gpu_smallest.py 217088 wan-14b-block,h3-block,llama3-8b-layer
"""
from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamplan
from common import cuda_peak, cuda_time, device_info, name_list, script_parser, write_results
from gpu_generic import BF16, BLOCKS, _diff, _first

ROUNDS = 8


def _live(args) -> int:
    return sum(a.numel() * a.element_size() for a in torch.utils._pytree.tree_leaves(args)
               if isinstance(a, torch.Tensor))


def run_case(case: str, n: int) -> dict:
    name, block, inputs, floor = BLOCKS[case](n)
    block = block.cuda().to(BF16).eval()
    args = inputs()
    kb = lambda b: b / n / 1024  # noqa: E731
    row = {"case": case, "block": name, "tokens": n, "floor_KB_per_token": kb(floor)}
    with torch.inference_mode():
        ref, stock_peak = cuda_peak(lambda: _first(block(*args)))
        stock_t = cuda_time(lambda: block(*args), repeats=2)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            noise = _diff(_first(block(*args)), ref)
        row.update(stock_KB_per_token=kb(stock_peak), stock_time_s=stock_t, stock_flash_vs_default_rel_diff=noise)
        budget, refusals = 1, []
        for _ in range(ROUNDS):
            handle = streamplan.apply(block, budget=budget, capture="prefer")
            try:
                out, peak = cuda_peak(lambda: _first(block(*args)))
                break
            except streamplan.BudgetError as exc:
                handle.remove()
                refusals.append(str(exc)[:200])
                if not exc.smallest_bytes or exc.smallest_bytes <= budget:
                    return {**row, "error": "a refusal named no larger budget", "refusals": refusals}
                budget = exc.smallest_bytes
        else:
            return {**row, "error": f"no budget ran in {ROUNDS} rounds", "refusals": refusals}
        diff = _diff(out, ref)
        del out
        t = cuda_time(lambda: block(*args), repeats=2)
        (plan,) = handle.plans[""]
        live = _live(args)
        row.update(budget_bytes=budget, budget_KB_per_token=kb(budget), budget_vs_floor=budget / floor,
                   live_input_bytes=live, peak_KB_per_token=kb(peak), peak_with_inputs_bytes=peak + live,
                   held=peak + live <= budget, tier=str(plan.tier), chunk=plan.chunk, kv=plan.kv,
                   head_groups=plan.head_groups, ffn_slice=plan.ffn_slice, predicted_total_bytes=plan.predicted_total,
                   time_s=t, time_ratio=t / stock_t, rel_diff=diff, refusals=refusals)
        handle.remove()
    del block, args, ref
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("tokens", nargs="?", type=int, default=217088, help="sequence length (default: %(default)s)")
    p.add_argument("cases", nargs="?", type=name_list(BLOCKS), default="wan-14b-block,h3-block,llama3-8b-layer",
                   help=f"comma-separated blocks of gpu_generic.py: {', '.join(BLOCKS)} (default: %(default)s)")
    a = p.parse_args()
    n, cases = a.tokens, a.cases
    info = device_info()
    rows = []
    for case in cases:
        rows.append(run_case(case, n))
        print(rows[-1], flush=True)
        write_results(f"gpu_smallest_{n}", {**info, "rows": rows})
    print(write_results(f"gpu_smallest_{n}", {**info, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
