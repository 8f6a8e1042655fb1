"""A small card in ComfyUI (issue 29): ComfyUI 0.33.0's own MiniMax-H3 (or Wan) at many layers, real width, random
weights in bf16, whole ``apply_model`` calls as its samplers make them, the weights held the way ComfyUI holds a model
that does not fit (``--weights lowvram``: on the CPU, each layer cast to the card per call; ``dynamic``: DynamicVRAM,
ComfyUI's default on NVIDIA). ``streamplan.integrations.comfy.patch(budget=B)`` with a size budget plans the whole
forward before it runs (``integrations/comfy/forward_budget.py``): B is the device memory the call may add above what
was allocated when it began, the per-call weight casts included.

For each budget the card is simulated by ``set_per_process_memory_fraction`` at what was allocated + B + 256 MiB
(expandable segments on): an accepted budget must run under that cap with its measured peak (the allocator's, above
the call's start) within B; a refused one (``--refuse-gib``) must raise ``BudgetError`` before anything runs, naming
the smallest budget that runs, which ``--run-smallest`` then runs. Stock's reference is the same ComfyUI model, its
weights held the same way, uncapped. Under DynamicVRAM the VBAR that holds the resident weights is CUDA memory outside
PyTorch's allocator: its size at the end of each call is written beside the peak (``vbar_bytes``: device memory in
use less what PyTorch reserved), since the card holds it too.

    python benchmarks/gpu_comfy_card.py --model h3 --layers 50 --tokens 217088 --weights lowvram --budgets-gib 8
    python benchmarks/gpu_comfy_card.py --model h3 --layers 50 --tokens 217088 --weights dynamic --budgets-gib 8
    python benchmarks/gpu_comfy_card.py --smoke --model h3 --layers 3   # CPU: the script end to end (budgets in
                                                                        # eighths of stock's peak)

Written to gpu_comfy_card_<model>_<layers>l_<weights>_<rows>.json, rewritten after every row.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # before torch touches CUDA

import torch  # noqa: E402

import gpu_comfy  # noqa: E402
import streamplan  # noqa: E402
from common import CAP_ALLOWANCE, cap_card, device_info, write_results  # noqa: E402
from streamplan.verify import compare_outputs  # noqa: E402

GIB = 1 << 30
REHEARSED = re.compile(r"rehearsed on fake tensors in ([0-9.]+) s")


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _allocated(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else 0


def _vbar_bytes(cuda: bool) -> int | None:
    """Device memory in use that PyTorch's allocator did not reserve (DynamicVRAM's VBAR, the CUDA context)."""
    if not cuda:
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def metered(patcher, cuda: bool) -> list:
    """``patcher`` with an outer DIFFUSION_MODEL wrapper (added before ``patch``: streamplan's runs inside it) that
    measures each model forward's peak above what was allocated when it began: what a ComfyUI budget promises
    (``apply_model``'s own latent-sized arithmetic around the forward is outside it, inside the cap's allowance). On
    CUDA the allocator's peak since the whole call began (an upper bound of the forward's); on the CPU the meter's."""
    import comfy.patcher_extension as ext
    peaks: list[int] = []

    def meter(executor, *args, **kwargs):
        if not cuda and torch._C._autograd._profiler_enabled():   # measured already (a rehearsal's own meter)
            return executor(*args, **kwargs)
        if not cuda:
            out, peak = streamplan.measure_peak(lambda: executor(*args, **kwargs), device="cpu")
            peaks.append(peak)
            return out
        entry = torch.cuda.memory_allocated()
        out = executor(*args, **kwargs)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - entry)
        return out

    ext.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "meter", meter, patcher.model_options,
                             is_model_options=True)
    return peaks


def timed_call(call, patcher, cuda: bool) -> tuple:
    """(output, seconds, the whole call's peak above its start or None on the CPU) of one ``apply_model`` call."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, before = time.perf_counter(), _allocated(cuda)
    out = call(patcher)
    _sync(cuda)
    return out, time.perf_counter() - start, torch.cuda.max_memory_allocated() - before if cuda else None


def run_budget(sc, stock, peaks: list, call, budget: int, ref, stock_s: float, cuda: bool) -> dict:
    """One budget: accepted (held under its cap, or out of memory: a broken promise) or refused before it ran.
    ``peaks``: the list ``stock``'s meter appends to (its patched clones keep the meter, outside streamplan's)."""
    patched = sc.patch(stock, budget=budget, min_tokens=0)
    del peaks[:]
    gc.collect()
    before = _allocated(cuda)
    cap_card(before + budget + CAP_ALLOWANCE if cuda else None)
    row = {"budget_bytes": budget, "budget_GiB": budget / GIB,
           "cap_bytes": before + budget + CAP_ALLOWANCE if cuda else None}
    start = time.perf_counter()
    try:
        out, first_s, call_peak = timed_call(call, patched, cuda)
        report = sc.report(patched)
        found = REHEARSED.findall(report)
        rehearsal_s = float(found[-1]) if found else 0.0
        peak = peaks[-1]
        row.update(first_call_s=first_s, rehearsal_s=rehearsal_s, time_s=first_s - rehearsal_s,
                   time_vs_stock=(first_s - rehearsal_s) / stock_s, peak_bytes=peak, peak_GiB=peak / GIB,
                   held=peak <= budget, call_peak_bytes=call_peak,
                   rel_diff_vs_stock=compare_outputs(out, ref)["output"]["rel"], vbar_bytes=_vbar_bytes(cuda),
                   report=report)
        del out
    except streamplan.BudgetError as exc:
        row.update(refused=True, refusal_s=time.perf_counter() - start, smallest_bytes=exc.smallest_bytes,
                   message=str(exc)[:900], allocated_after_minus_before=_allocated(cuda) - before)
    except torch.OutOfMemoryError as exc:
        row.update(error=f"out of memory under an accepted budget: {str(exc)[:300]}")
    except Exception as exc:  # noqa: BLE001 -- the row says what failed; the next budget still runs
        traceback.print_exc()
        row.update(error=f"{type(exc).__name__}: {exc}"[:600])
    finally:
        cap_card(None)
        patched = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("h3", "wan"), default="h3",
                   help="h3: ComfyUI's MiniMax-H3 (--tokens counting every packed row); wan: WanModel at "
                        "Wan2.1-14B width")
    p.add_argument("--layers", type=int, default=50, help="DiT blocks (default 50, H3's count; smoke 3)")
    p.add_argument("--tokens", type=int, default=None, help="rows a block sees (default 217088; smoke 1024)")
    p.add_argument("--text", type=int, default=None, help="text tokens (default 512; smoke 16)")
    p.add_argument("--audio", type=int, default=None, help="h3: audio rows, even (default 2000; smoke 80)")
    p.add_argument("--weights", choices=("lowvram", "dynamic", "device"), default="lowvram",
                   help="lowvram: on the CPU, cast per call (default); dynamic: DynamicVRAM (comfy-aimdo; GPU only); "
                        "device: all on the card (the comparison)")
    p.add_argument("--budgets-gib", default="8", help="comma list of budgets in GiB (smoke: eighths of stock's peak)")
    p.add_argument("--refuse-gib", type=float, default=0.25, help="a budget expected to be refused (0: none)")
    p.add_argument("--run-smallest", action="store_true", help="also run at the refusal's smallest budget")
    p.add_argument("--warm-tokens", type=int, default=0, help="h3: the first (untimed) call, in which DynamicVRAM "
                   "faults its weights in and lowvram sets its casts up, at this many packed rows rather than the "
                   "measured length (0: the measured call itself; 50 layers at 217k rows take minutes a call)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    a = p.parse_args()
    if a.weights == "dynamic" and a.smoke:
        p.error("--weights dynamic needs a GPU (comfy-aimdo's VBAR is CUDA memory): drop --smoke")
    if a.warm_tokens and a.model != "h3":
        p.error("--warm-tokens is for --model h3")
    if a.layers < 1:
        p.error(f"--layers {a.layers}: give at least 1")
    try:   # read before the model is built: a wrong value says so at once, not after minutes of stock
        budgets_gib = [float(b) for b in a.budgets_gib.split(",") if b]
    except ValueError:
        p.error(f"--budgets-gib {a.budgets_gib!r}: give a comma list of numbers, e.g. 8 or 6,8")
    cuda, dtype = not a.smoke, torch.bfloat16
    layers = 3 if a.smoke and a.layers == 50 else a.layers
    n, text = a.tokens or (1024 if a.smoke else 217088), a.text or (16 if a.smoke else 512)
    dev = torch.device("cuda" if cuda else "cpu")
    info = device_info() if cuda else {"device": "cpu (smoke)", "torch": torch.__version__}
    print(info, flush=True)
    comfy = gpu_comfy.import_comfy(cpu=not cuda, dynamic=a.weights == "dynamic")
    import streamplan.integrations.comfy as sc
    cpu = dev if a.weights == "device" else torch.device("cpu")   # where the model is built
    t0 = time.perf_counter()
    if a.model == "h3":
        audio = a.audio if a.audio is not None else (80 if a.smoke else 2000)
        base, x, cond, grid, _, _ = gpu_comfy.build_h3(comfy, dev, dtype, a.smoke, n, text, audio, cpu,
                                                            layers=layers, init_dev=dev)
        tokens = text + audio + grid[0] * grid[1] * grid[2]
    else:
        base, x, cond, grid, _ = gpu_comfy.build(comfy, dev, dtype, a.smoke, n, text, cpu, layers=layers,
                                                 init_dev=dev)
        tokens = grid[0] * grid[1] * grid[2]
    stock, held = gpu_comfy.held_as(comfy, base, dev, a.weights, 0.0)
    cond = cond()
    print(f"{a.model}, {layers} layers, {tokens} rows, built in {time.perf_counter() - t0:.0f} s; {held}", flush=True)
    call = lambda patcher: gpu_comfy.sample_call(patcher, x, cond)  # noqa: E731
    name = f"gpu_comfy_card_{a.model}_{layers}l_{a.weights}_{'smoke_' if a.smoke else ''}{tokens}"
    payload = {**info, "model": f"ComfyUI 0.33.0 {a.model}, {layers} layers, real width" if cuda else "smoke",
               "tokens": tokens, "layers": layers, "weights": held, "allowance_bytes": CAP_ALLOWANCE, "rows": []}

    def keep(row: dict) -> None:
        payload["rows"].append(row)
        print({k: v for k, v in row.items() if k != "report"}, flush=True)
        write_results(name, payload)

    if a.warm_tokens:   # the first call: DynamicVRAM faults its weights in, lowvram sets its casts up
        wx, wcond, _, _ = gpu_comfy.h3_call(comfy, base, dev, dtype, a.warm_tokens, text, audio,
                                            gpu_comfy.H3_SMOKE_DIMS.get("text_dim", 5120) if a.smoke
                                            else gpu_comfy.H3_DIMS.get("text_dim", 5120))
        gpu_comfy.sample_call(stock, wx, wcond())
        del wx
    else:
        call(stock)
    stock_peaks = metered(stock, cuda)
    ref, stock_s, stock_call_peak = timed_call(call, stock, cuda)
    stock_peak = stock_peaks[-1]
    payload.update(stock_peak_bytes=stock_peak, stock_call_peak_bytes=stock_call_peak, stock_time_s=stock_s,
                   stock_vbar_bytes=_vbar_bytes(cuda))
    print(f"stock: forward peak {stock_peak / GIB:.2f} GiB above its start, {stock_s:.1f} s", flush=True)
    scale = GIB if cuda else stock_peak / 8
    for budget in [int(b * scale) for b in budgets_gib]:
        keep(run_budget(sc, stock, stock_peaks, call, budget, ref, stock_s, cuda))
    if a.refuse_gib > 0:
        keep(run_budget(sc, stock, stock_peaks, call, int(a.refuse_gib * scale), ref, stock_s, cuda))
        smallest = payload["rows"][-1].get("smallest_bytes")
        if a.run_smallest and smallest:
            keep(run_budget(sc, stock, stock_peaks, call, smallest, ref, stock_s, cuda))
    print(write_results(name, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
