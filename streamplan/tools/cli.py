"""The ``streamplan`` command.

Parsing, ``--help`` and ``--version`` import nothing heavy: torch (and diffusers, transformers) are imported inside the
commands, after the arguments are checked. The case and family names offered here are kept equal to
``streamplan.tools.demo.CASES``, ``streamplan.tools.families.FAMILIES`` and ``streamplan.tools.bench.CASES`` by the
tests.
"""
from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
import textwrap
import time
from typing import Callable

DESCRIPTION = (
    "streamplan runs long-sequence transformer inference in bounded activation memory, with the model's own math. "
    "It finds the transformer blocks of a model (each captured to a graph and checked op by op), runs them over the "
    "sequence in bounded chunks, and leaves stock what it does not understand. "
    "In Python: `handle = streamplan.apply(model)`. The commands below show it at work; "
    "`streamplan COMMAND --help` lists each command's options.")

# torch-free catalogues of what the commands can build (tests keep them equal to the modules that build them)
DEMO_CASES = {
    "wan-block": "Wan2.1-1.3B WanTransformerBlock (diffusers) at its real width: dim 1536, ffn 8960, 12 heads",
    "wan-ffn": "Wan2.1 FeedForward (diffusers) at 1/10 width: dim 512, ffn 1382, gelu-tanh",
}
DEMO_DEFAULT_TOKENS = {"wan-block": 4096, "wan-ffn": 16384}
PLAN_FAMILIES = {
    "wan-14b-block": "Wan2.1-14B WanTransformerBlock (diffusers): dim 5120, ffn 13824, 40 heads",
    "wan-14b-model": "Wan2.1-14B WanTransformer3DModel (diffusers): 40 layers, 5120 wide, 512 text tokens; the whole "
                     "forward planned (its hidden state, rotary tables and head beside each block)",
    "wan-1.3b-block": "Wan2.1-1.3B WanTransformerBlock (diffusers): dim 1536, ffn 8960, 12 heads",
    "flux-double-block": "Flux.1 FluxTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
    "flux-single-block": "Flux.1 FluxSingleTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
    "flux2-double-block": "FLUX.2 Flux2TransformerBlock (diffusers): dim 6144, 48 heads, 512 text tokens",
    "flux2-single-block": "FLUX.2 Flux2SingleTransformerBlock (diffusers): dim 6144, 48 heads, 512 text tokens",
    "ltx-video-block": "LTX-Video LTXVideoTransformerBlock (diffusers): dim 2048, 32x64 heads, 128 text tokens",
    "ltx2-block": "LTX-2 LTX2VideoTransformerBlock (diffusers): 4096-wide video over 32x128 heads, 2048-wide audio "
                  "(834 rows), 1,024 text tokens, image-to-video (per-row modulation)",
    "hunyuan-double-block": "HunyuanVideo HunyuanVideoTransformerBlock (diffusers): dim 3072, 24x128 heads, 256 text "
                            "tokens",
    "qwenimage-block": "Qwen-Image QwenImageTransformerBlock (diffusers): dim 3072, 24x128 heads, 512 text tokens with "
                       "the padded prompt's mask as its pipeline passes it",
    "zimage-block": "Z-Image ZImageTransformerBlock (diffusers): dim 3840, 30x128 heads, rotary in an autocast region",
    "h3-block": "MiniMax-H3 MiniMaxH3TransformerBlock (diffusers): 5376 wide, 56x128 heads, SwiGLU 14336",
    "h3-model": "MiniMaxH3Transformer3DModel (diffusers) at real width, 2 layers: 512 text and 2,000 audio rows, the "
                "rest video",
    "ltx2-model": "LTX2VideoTransformer3DModel (diffusers) at real width, 48 layers, image-to-video (a timestep per "
                  "video row); --tokens counts video rows (2,040 a latent frame at 1920x1088)",
    "llama3-8b-layer": "Llama-3-8B LlamaDecoderLayer (transformers, sdpa): 4096 hidden, 32/8 heads",
    "qwen3-moe-layer": "Qwen3-30B-A3B Qwen3MoeDecoderLayer (transformers, sdpa): 2048 hidden, 32/4 heads, 128 experts "
                       "of 768, 8 a token",
    "llama3-8b-model": "Llama-3-8B LlamaForCausalLM (transformers, sdpa), 32 layers: a prefill as generate runs it "
                       "(no cache, the last position's logits); the whole forward planned",
}
BENCH_CASES = {
    **PLAN_FAMILIES,
    "wan-14b-model-2-layers": "WanTransformer3DModel (diffusers) at Wan2.1-14B width, 2 layers, 480p",
    "llama3-8b-model-2-layers": "LlamaForCausalLM (transformers) at Llama-3-8B width, 2 layers, prefill with logits "
                                "for the last token",
}
for _family in ("wan-1.3b-block", "wan-14b-model", "ltx2-model", "llama3-8b-model"):   # planned, not benched
    del BENCH_CASES[_family]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_CHOICES = ("device", "host", "int8", "fp8")   # apply's kv= (streamplan.execute.kv_stores.KV_KINDS)
FUSE_CHOICES = {"auto": None, "on": True, "off": False}   # apply's fuse=
FUSE_HELP = ("compile a captured block's element-wise chains into exact kernels (checked bit for bit before use): "
             "auto = on CUDA with Triton where chunks are large enough, on = anywhere Inductor runs (the first "
             "call compiles, seconds), off = never (default: auto)")
REPLAY_CHOICES = {"auto": None, "on": True, "off": False}   # apply's replay=
REPLAY_HELP = ("replay a captured block's chunks after the first two as recorded CUDA graphs (one launch where each "
               "of ~100 ops would cost microseconds): auto = where the time model says it is faster, on a device whose "
               "replay rates are fitted (none yet), on = wherever the block allows it, off = never (default: auto)")
_BENCH_MODE = re.compile(r"^(stock|naive-chunked-ffn|forward-chunking|streamplan-[1-9][0-9]*"
                         r"|streamplan-[0-9]*\.?[0-9]+GiB|streamplan-floor[0-9]*\.?[0-9]+)$")
_NEGATIVE_LOOKING = re.compile(r"^-\.?[0-9]")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _version() -> str:
    from .. import __version__
    return __version__


# --- argument types: each names what it accepts; argparse prefixes the option ----------------------------------------

def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\+?[0-9]+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _positive_int_list(text: str) -> list[int]:
    try:
        return [_positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers of at least 1, got {text!r}") from None


def _budget(text: str) -> str:
    """Checked now (before any model is built), passed on as typed: ``apply`` resolves "auto" on the device."""
    if text.strip().lower() == "auto":
        return "auto"
    from ..plan.budget import parse_budget  # imports torch: only when a budget is given
    try:
        parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _html_path(text: str) -> str:
    """A file to write: its folder must exist (checked now, before minutes of work), and it must not be a folder."""
    import os
    path = os.path.expanduser(text.strip())
    folder = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"must be a file to write (e.g. timeline.html), got {text!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} does not exist (for {text!r})")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} cannot be written to (for {text!r})")
    return path


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def _bench_cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",")]
    unknown = [c for c in cases if c not in BENCH_CASES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(map(repr, unknown))}; choose from "
                                         f"{', '.join(BENCH_CASES)} (comma-separated)")
    return cases


def _bench_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",")]
    unknown = [m for m in modes if not _BENCH_MODE.match(m)]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(map(repr, unknown))}; modes are stock, naive-chunked-ffn, forward-chunking, "
            f"streamplan-<rows> (e.g. streamplan-4096), streamplan-<N>GiB, streamplan-floor<x> (e.g. "
            f"streamplan-floor1.15), comma-separated")
    return modes


def _width() -> int:
    return max(40, min(110, shutil.get_terminal_size().columns - 2))


def _wrap(text: str) -> str:
    return textwrap.fill(text, _width())


def _catalogue(title: str, entries: dict[str, str], extra: dict[str, str] | None = None) -> str:
    """A titled two-column list for an epilog: each name and its description, wrapped under the description."""
    name_width = max(map(len, entries)) + 4
    lines = [f"{title}:"]
    for name, desc in entries.items():
        lines.append(textwrap.fill(f"{desc}{(extra or {}).get(name, '')}", _width(),
                                   initial_indent=f"  {name}".ljust(name_width), subsequent_indent=" " * name_width))
    return "\n".join(lines)


# --- progress ------------------------------------------------------------------------------------------------------

def _progress_printer() -> Callable[[str], None]:
    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
    return progress


class _Stages:
    """``[i/n] what ...`` on stderr as each stage starts, and how long it took when it ends."""

    def __init__(self, total: int, progress: Callable[[str], None]):
        self.total, self.progress, self.index, self.start = total, progress, 0, None

    def __call__(self, what: str) -> None:
        self.done()
        self.index += 1
        self.start = time.perf_counter()
        self.progress(f"[{self.index}/{self.total}] {what} ...")

    def done(self) -> None:
        if self.start is not None:
            self.progress(f"      done in {time.perf_counter() - self.start:.1f} s")
            self.start = None


# --- commands ------------------------------------------------------------------------------------------------------

def _check_device(parser: argparse.ArgumentParser, device: str | None) -> None:
    import torch

    if device is None or not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = (f"this torch build ({torch.__version__}) has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible")
        parser.error(f"argument --device: {device!r} asked for, but {why}; use --device cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        parser.error(f"argument --device: {device!r} asked for, but there are {torch.cuda.device_count()} CUDA "
                     f"device(s): use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def _demo(args: argparse.Namespace) -> int:
    import torch

    _check_device(args._parser, args.device)   # before saying anything: a usage error is one line
    tokens = args.tokens or DEMO_DEFAULT_TOKENS[args.case]
    print(f"streamplan demo {args.case}: {DEMO_CASES[args.case]}; {tokens} tokens, {args.dtype}; "
          f"runs it stock, then streamed, and compares", file=sys.stderr, flush=True)
    from ..plan.budget import fmt_bytes
    from .demo import run_demo

    r = run_demo(args.case, tokens=tokens, device=args.device, dtype=getattr(torch, DTYPES[args.dtype]),
                 budget=args.budget, chunk_tokens=args.chunk_tokens, ffn_slice=args.ffn_slice,
                 fuse=FUSE_CHOICES[args.fuse], progress=_progress_printer())
    print(r.report)
    print(f"\n{r.case}: {r.tokens} tokens, {r.dtype} on {r.device}; peak tensor memory of the call with its inputs "
          f"({fmt_bytes(r.input_bytes)}), weights not counted (the report's baseline)")
    print(f"  stock peak      (measured)  {fmt_bytes(r.stock_total):>12}")
    print(f"  streamed peak   (measured)  {fmt_bytes(r.streamed_total):>12}   "
          f"({r.streamed_total / max(r.stock_total, 1):.1%} of stock)")
    if r.predicted_peak is not None:
        print(f"  streamed peak   (predicted) {fmt_bytes(r.predicted_peak):>12}   the report's figure, by the planner "
              f"before running")
    print(f"  stock time      (measured)  {r.stock_time_s:>10.2f} s")
    print(f"  streamed time   (measured)  {r.streamed_time_s:>10.2f} s   ({r.time_ratio:.2f}x stock; "
          f"the first streamed call includes planning{' and compiling' if r.fusing else ''})")
    print(f"  max relative difference to stock: {r.max_rel_diff:.2e}")
    if args.plot:
        from ..timeline import write_html
        path = write_html([r.timeline], args.plot)
        print(f"  memory timeline: {path} (open it in a browser: a row per streamed call, predicted beside measured)")
    print(f"\n{r.summary()}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    stages = _Stages(3, _progress_printer())
    stages("loading torch")
    import torch

    import streamplan
    from .families import FAMILIES, on_meta

    family = FAMILIES[args.family]
    dtype = getattr(torch, DTYPES[args.dtype])
    stages(f"building {family.name} on the meta device (shapes only, nothing allocated)")
    module, inputs = on_meta(family, args.tokens, dtype)
    call = lambda: module(*inputs, **(family.call_kwargs or {}))  # noqa: E731
    stages(f"planning {args.tokens} tokens")
    handle = streamplan.apply(module, budget=args.budget, chunk_tokens=args.chunk_tokens, kv=args.kv,
                              replay=REPLAY_CHOICES[args.replay])
    try:
        with torch.inference_mode():
            call()
    except streamplan.BudgetError as exc:
        stages.done()
        handle.remove()
        print(f"streamplan: {exc}", file=sys.stderr)
        if args.smallest and args.chunk_tokens is None:
            _print_smallest(module, call, args.kv, file=sys.stderr)
        return 2
    stages.done()
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
        print("\nKB per token above the inputs (from the planner's memory model; nothing was measured):")
        print(f"  stock (estimate, not measured) {kb(plan.stock_peak):8.1f}")
        print(f"  planned (predicted)            {kb(plan.predicted_peak):8.1f}")
        print(f"  floor (residual + K + V)       {kb(floor * args.tokens):8.1f}")
    handle.remove()
    if args.smallest and args.chunk_tokens is None:
        print()
        _print_smallest(module, call, args.kv)
    return 0


SMALLEST_ROUNDS = 8   # refusals followed at most (each names the smallest budget of the operation it refused)


def _print_smallest(module, call: Callable[[], object], kv: str, file=None) -> None:
    """The smallest byte budget under which every operation of ``module`` plans at this length, found by following
    each refusal's ``BudgetError.smallest_bytes`` (on meta tensors: planning runs nothing), and the card it needs with
    the module's weights on it."""
    import torch

    import streamplan
    from ..plan.budget import fmt_bytes

    print("finding the smallest budget (each refusal names the next; near the floor the meta run has many small "
          "chunks: up to a minute) ...", file=sys.stderr, flush=True)
    budget = 1 << 20   # below any forward's smallest, above what a plan's margin rounds to nothing
    for _ in range(SMALLEST_ROUNDS):
        handle = streamplan.apply(module, budget=budget, kv=kv)
        try:
            with torch.inference_mode():
                call()
            ratios = [p.predicted_time_ratio for ps in handle.plans.values() for p in ps
                      if p.predicted_time_ratio is not None]
            break
        except streamplan.BudgetError as exc:
            if not exc.smallest_bytes or exc.smallest_bytes <= budget:
                print("smallest budget: not found (a refusal named no smaller budget that runs)", file=file)
                return
            budget = exc.smallest_bytes
        finally:
            handle.remove()
    else:
        print(f"smallest budget: not found in {SMALLEST_ROUNDS} refusals", file=file)
        return
    weights = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    print(f"smallest budget that plans it (kv={kv}): {fmt_bytes(budget)} beside the inputs counted in it; "
          f"with its weights ({fmt_bytes(weights)}) on the card: {fmt_bytes(budget + weights)}", file=file)
    if ratios:   # the narrowest plans are slow: say how slow, on the time model's rates
        print(f"  predicted time there: {max(ratios):.2f}x stock's (the slowest streamed operation, by the time "
              f"model fitted on an H200)", file=file)


def _bench(args: argparse.Namespace) -> int:
    import json
    import os

    import torch

    if not torch.cuda.is_available():
        print("streamplan bench measures with the CUDA allocator and CUDA events: it needs a CUDA GPU "
              "(use `streamplan plan` to see plans without one)", file=sys.stderr)
        return 2
    from .bench import CASES, as_dicts, header, plot, run_case, to_markdown

    rows = []
    timelines = [] if args.plot else None
    total = len(args.cases) * len(args.tokens) * len(args.modes)
    progress = _progress_printer()
    print(to_markdown([]), flush=True)
    for i, name in enumerate(args.cases, 1):
        progress(f"[case {i}/{len(args.cases)}] {name}: {BENCH_CASES[name]}")
        for row in run_case(CASES[name](), args.tokens, args.modes, args.repeats, progress=progress, kv=args.kv,
                            fuse=FUSE_CHOICES[args.fuse], replay=REPLAY_CHOICES[args.replay], timelines=timelines):
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
    if timelines:
        from ..timeline import write_html
        print(f"memory timeline of each streamplan row: {write_html(timelines, args.plot)} (open it in a browser)")
    print(f"results in {args.out}")
    return 0


# --- the parser ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="streamplan", description=_wrap(DESCRIPTION), formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"streamplan {_version()}",
                        help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log planning decisions (also accepted after the command: `streamplan demo -v`)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log planning decisions")
    kv_help = ("where captured blocks keep K/V between phases: device (exact, default; below the floor the planner "
               "takes the faster of head groups, L3, and on CUDA host-staged K/V, L4), host (forces L4: pinned host "
               "memory), int8 or fp8 (L5: compressed, approximate, error reported)")
    budget_help = ("peak memory the planner may use, inputs included: bytes, a size like '12GiB' or '900MB', or "
                   "'auto' (the free memory less 512 MiB)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    demo = sub.add_parser(
        "demo", parents=[common], formatter_class=fmt,
        help="run a small embedded model stock, then streamed, on this machine (CPU, or CUDA when available), and "
             "compare the measured peak memory, time and outputs",
        description=_wrap("Build a real diffusers module with random weights, run it stock and then streamed by "
                          "streamplan on the same input, and print the peak memory each measured (the call with its "
                          "inputs, weights not counted: the report's baseline), the planner's prediction on the same "
                          "baseline, both wall times and the largest output difference, then what it showed in one "
                          "sentence. --plot PATH also writes the memory timeline. The wan-block case takes about "
                          "half a minute on a laptop CPU."),
        epilog=_catalogue("cases", DEMO_CASES, {k: f" (default {v} tokens)" for k, v in DEMO_DEFAULT_TOKENS.items()}))
    demo.add_argument("--case", choices=list(DEMO_CASES), default="wan-block",
                      help="which module, listed below (default: wan-block)")
    demo.add_argument("--tokens", type=_positive_int, default=None, metavar="N",
                      help="sequence length (default: the case's own, listed below)")
    demo.add_argument("--device", type=_device, default=None,
                      help="cpu, cuda or cuda:N (default: cuda when available)")
    demo.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights and inputs (default: fp32)")
    demo.add_argument("--budget", type=_budget, default=None, metavar="SIZE",
                      help=budget_help + " (default: none: fixed chunks of tokens/8, so that the demo streams)")
    demo.add_argument("--chunk-tokens", type=_positive_int, default=None, metavar="N",
                      help="force row streaming with this many tokens per chunk")
    demo.add_argument("--ffn-slice", type=_positive_int, default=None, metavar="N",
                      help="force sliced MLPs holding this many hidden features' worth at a time")
    demo.add_argument("--fuse", choices=list(FUSE_CHOICES), default="auto", help=FUSE_HELP)
    demo.add_argument("--plot", type=_html_path, default=None, metavar="PATH",
                      help="also write the streamed call's memory timeline to PATH, one self-contained HTML file "
                           "(a row per streamed call and phase: predicted peak and its parts, measured peaks, stock)")
    demo.set_defaults(func=_demo, _parser=demo)

    plan = sub.add_parser(
        "plan", parents=[common], formatter_class=fmt,
        help="print the plan for a real-width model family at a token count and budget; on meta tensors, runs "
             "nothing",
        description=_wrap("Build a real-width module on the meta device (shapes only: no memory, no compute), let "
                          "streamplan plan it, and print the plan: tiers, chunks, the predicted peak and the stock "
                          "estimate (from the memory model, not a measurement)."),
        epilog=_catalogue("families", PLAN_FAMILIES))
    plan.add_argument("--family", choices=list(PLAN_FAMILIES), default="wan-14b-block",
                      help="which module, listed below (default: wan-14b-block)")
    plan.add_argument("--tokens", type=_positive_int, default=65536, metavar="N",
                      help="sequence length (default: 65536)")
    plan.add_argument("--budget", type=_budget, default=None, metavar="SIZE",
                      help=budget_help + " (default: none: fixed 4096-token chunks)")
    plan.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights and inputs (default: bf16)")
    plan.add_argument("--chunk-tokens", type=_positive_int, default=None, metavar="N",
                      help="force row streaming with this many tokens per chunk")
    plan.add_argument("--kv", choices=KV_CHOICES, default="device", help=kv_help)
    plan.add_argument("--replay", choices=list(REPLAY_CHOICES), default="auto", help=REPLAY_HELP)
    plan.add_argument("--json", action="store_true", help="print the plans as JSON instead of the report")
    plan.add_argument("--smallest", action="store_true",
                      help="also find the smallest budget every operation plans under at this length, and the card "
                           "it needs with the weights (up to a minute: near the floor the meta run has many small "
                           "chunks)")
    plan.set_defaults(func=_plan, _parser=plan)

    bench = sub.add_parser(
        "bench", parents=[common], formatter_class=fmt,
        help="measure stock, peers and streamplan on your CUDA GPU; writes JSON, Markdown and a plot",
        description=_wrap("Measure peak memory (CUDA allocator) and time (CUDA events) of stock, the peers and "
                          "streamplan at real width on this machine's GPU. Needs a CUDA GPU; takes minutes."),
        epilog=_catalogue("cases", BENCH_CASES))
    bench.add_argument("--cases", type=_bench_cases, default="wan-14b-block,flux-single-block", metavar="CASES",
                       help="comma-separated cases, listed below (default: wan-14b-block,flux-single-block)")
    bench.add_argument("--tokens", type=_positive_int_list, default="32768,65536,131072", metavar="N,N,...",
                       help="comma-separated sequence lengths (default: 32768,65536,131072)")
    bench.add_argument("--modes", type=_bench_modes, metavar="MODES",
                       default="stock,naive-chunked-ffn,streamplan-4096,streamplan-16384",
                       help="comma-separated: stock, naive-chunked-ffn, forward-chunking, streamplan-<rows>, "
                            "streamplan-<N>GiB, streamplan-floor<x> "
                            "(default: stock,naive-chunked-ffn,streamplan-4096,streamplan-16384)")
    bench.add_argument("--kv", choices=KV_CHOICES, default="device",
                       help=kv_help + "; applies to the streamplan modes")
    bench.add_argument("--fuse", choices=list(FUSE_CHOICES), default="auto",
                       help=FUSE_HELP + "; applies to the streamplan modes")
    bench.add_argument("--replay", choices=list(REPLAY_CHOICES), default="auto",
                       help=REPLAY_HELP + "; applies to the streamplan modes")
    bench.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                       help="timed runs per row, the median reported (default: 3)")
    bench.add_argument("--out", default="streamplan-bench", metavar="DIR",
                       help="output folder (default: streamplan-bench)")
    bench.add_argument("--plot", type=_html_path, default=None, metavar="PATH",
                       help="also write each streamplan row's memory timeline to PATH, one self-contained HTML file "
                            "(a row per streamed call and phase: predicted peak and its parts, measured peaks, stock; "
                            "one more call per row, metered by the profiler)")
    bench.set_defaults(func=_bench, _parser=bench)
    parser.value_options = {s for p in (parser, demo, plan, bench) for a in p._actions if a.nargs is None
                            for s in a.option_strings if s.startswith("--")}   # options that take one value
    return parser


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--budget -5GiB`` -> ``--budget=-5GiB``: argparse takes a value that starts with '-' and is not a plain number
    for an option, and would say "expected one argument" instead of what is wrong with the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in parser.value_options and _NEGATIVE_LOOKING.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 a usage error or an unreachable budget)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(_join_negative_values(parser, argv))
    except SystemExit as exc:   # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except SystemExit as exc:   # a usage error found once torch is loaded (e.g. --device cuda without CUDA)
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:  # BudgetError included: the smallest reachable peak is in its message
        print(f"streamplan: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
