"""The coverage catalogue: every transformer block class of the pinned diffusers and every decoder layer class of the
main transformers families, and what streamplan does with each, found by running it.

The classes are enumerated, not listed: diffusers' blocks are the classes its transformer models name in
``_no_split_modules`` plus the ``*Block`` / ``*Layer`` classes defined next to them, kept when their ``__init__``
builds an attention; transformers' are the ``*DecoderLayer`` classes (and the ``_no_split_modules`` classes) of the
``modeling_<family>`` module of each family in ``FAMILIES``. A class with a ``Case`` (``diffusers_cases``,
``transformers_cases``) is built tiny and called on CPU at a small row count: once with ``streamplan.apply``'s
defaults, and when those did not take the captured path, once more with ``capture="prefer"``; the row says what
the report said and how close the output is to the class's own forward. A class without a case says so.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import Case

# causal-LM families whose decoder layers the catalogue lists (transformers.models.<family>.modeling_<family>)
FAMILIES = [
    "llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "gemma",
    "gemma2", "gemma3", "phi", "phi3", "phimoe", "granite", "granitemoe", "olmo", "olmo2", "olmo3", "cohere",
    "cohere2", "stablelm", "gpt_neox", "falcon", "falcon_h1", "starcoder2", "glm", "glm4", "helium", "smollm3",
    "arcee", "apertus", "seed_oss", "hunyuan_v1_dense", "exaone4", "ernie4_5", "nemotron", "persimmon", "gpt2",
    "gpt_bigcode", "gptj", "codegen", "bloom", "opt", "mpt", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4",
    "jamba", "lfm2", "minimax", "dbrx",
]

ROWS = {"diffusers": 400, "transformers": 256}   # rows per case call: several chunks (the diffusers cases' grids
                                                 # fit 400; longer than the transformers sliding-window cases' window)
CHUNK = 64


@dataclass
class Row:
    library: str
    cls: str
    module: str
    case: str = ""
    outcome: str = "no test case yet"
    note: str = ""


# -- the classes --------------------------------------------------------------------------------------------------
def _builds_attention(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    return "attn" in src.lower() or "attention" in src.lower()


def _defined(mod) -> Iterable[tuple[str, type]]:
    return ((n, c) for n, c in vars(mod).items() if inspect.isclass(c) and c.__module__ == mod.__name__)


def diffusers_classes() -> list[tuple[type, str]]:
    """(class, where) for every block class of diffusers' transformer models; unimportable modules are skipped."""
    import diffusers.models.transformers as pkg
    found: dict[type, str] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        try:
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception:  # noqa: BLE001 -- an optional dependency missing: not a block of this install
            continue
        named: set[str] = set()
        for _, c in _defined(mod):
            named |= set(getattr(c, "_no_split_modules", None) or ())
        cands = [getattr(mod, n, None) for n in sorted(named)]
        cands += [c for n, c in _defined(mod) if n.endswith(("Block", "Layer"))]
        for c in cands:
            if inspect.isclass(c) and issubclass(c, nn.Module) and c not in found and _builds_attention(c) and \
                    c.forward is not nn.Module.forward:   # a holder of parts another block runs is not a block
                found[c] = c.__module__
    return sorted(found.items(), key=lambda kv: (kv[1], kv[0].__name__))


def transformers_classes(families: Iterable[str] = FAMILIES) -> list[tuple[type, str]]:
    """(class, where) for the decoder layer classes of the listed families present in this transformers."""
    found: dict[type, str] = {}
    for fam in families:
        try:
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        except Exception:  # noqa: BLE001 -- a family this transformers does not have
            continue
        named: set[str] = set()
        for _, c in _defined(mod):
            named |= set(getattr(c, "_no_split_modules", None) or ())
        for n, c in _defined(mod):
            if issubclass(c, nn.Module) and (n.endswith("DecoderLayer") or n in named) and c not in found:
                found[c] = mod.__name__
    return list(found.items())


def _case_classes(cases: dict[str, Case]) -> dict[type, list[Case]]:
    out: dict[type, list[Case]] = {}
    for case in cases.values():
        mod, _, name = case.cls_path.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), name)
        except Exception:  # noqa: BLE001
            continue
        out.setdefault(cls, []).append(case)
    return out


# -- running a case ----------------------------------------------------------------------------------------------
def _floats(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _rel(out, ref) -> float:
    worst = 0.0
    for o, r in zip(_floats(out), _floats(ref)):
        if o.shape != r.shape:
            return float("inf")
        worst = max(worst, ((o.float() - r.float()).abs().max()
                            / r.float().abs().max().clamp_min(1e-30)).item())
    return worst


def _stock_reason(handle, entry) -> str:
    if entry is not None:
        for note in entry.runtime_notes:
            if note.startswith("ran stock: "):   # without the capture's timing: the table is committed
                return re.sub(r" \(captured in [0-9.]+ s\)", "", note[len("ran stock: "):])
        if entry.plans:
            return "the planner kept it stock (L0)"
    if handle.skipped:
        return handle.skipped[0].reason
    return "not recognised (no ModuleList element or root with two parts and three linear layers)"


def _once(module: nn.Module, args: tuple, kwargs: dict, ref, capture: str) -> tuple[str, str]:
    """(path, text) of one streamed call: path is "captured" (the captured-graph path decided, streamed or not),
    "hand" (hand-written recognizers streamed it or parts of it) or "stock" (nothing took it)."""
    import streamplan
    from ...specs import GraphSpec
    handle = streamplan.apply(module, chunk_tokens=CHUNK, capture=capture)
    try:
        with torch.no_grad():
            out = module(*args, **kwargs)
        entries = dict(handle.installed)
        root = entries.get("")
        streamed = {n: e for n, e in entries.items() if any(p.tier != "L0" for p in e.plans.values())}
        rel = _rel(out, ref)
        exact = f"exact to {rel:.1e}" if rel > 0 else "bit-exact"
        if root is not None and isinstance(root.spec, GraphSpec):
            if "" in streamed:
                tiers = "/".join(sorted({p.tier for p in root.plans.values()}))
                return "captured", f"streams (captured, {tiers}), {exact}"
            parts = sorted(n for n in streamed if n)   # its graph refused, its parts' recognizers took the call
            tiers = "/".join(sorted({p.tier for n in parts for p in streamed[n].plans.values()}))
            return "captured", f"stays stock: {_stock_reason(handle, root)}" + (
                f"; its parts stream ({', '.join(parts)}; {tiers}), {exact}" if parts else "")
        if streamed:
            tiers = "/".join(sorted({p.tier for e in streamed.values() for p in e.plans.values()}))
            if "" in streamed:
                return "hand", f"hand-written recognizer ({root.spec.label}, {tiers}), {exact}"
            whole = next((s.reason for s in handle.skipped if s.name == ""), None)
            return "hand", (f"hand-written recognizers on parts only ({', '.join(sorted(streamed))}; {tiers}), "
                            f"{exact}; the rest runs stock" + (f" (the block: {whole})" if whole else ""))
        return "stock", f"stays stock: {_stock_reason(handle, root)}"
    finally:
        handle.remove()


def run_case(case: Case, rows: int) -> str:
    """What streamplan does with the case's block: by default, and on the captured path if the default took another."""
    cpu = torch.device("cpu")
    try:
        torch.manual_seed(0)
        module = case.build()
        args, kwargs = case.inputs(rows, cpu, torch.float32)
        with torch.no_grad():
            ref = module(*args, **kwargs)
        kind, text = _once(module, args, kwargs, ref, "fallback")
        if kind != "captured":   # the default did not take the captured path: show that path too
            _, captured = _once(module, args, kwargs, ref, "prefer")
            text += f"; captured path: {captured}"
        return text
    except Exception as exc:  # noqa: BLE001 -- the catalogue reports a broken case, it does not stop
        return f"error running the case: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


# -- the table ----------------------------------------------------------------------------------------------------
def _libraries():
    libs: list[tuple[str, Callable[[], list[tuple[type, str]]], dict[str, Case]]] = []
    try:
        import diffusers  # noqa: F401
        from .diffusers_cases import CASES as dcases
        libs.append(("diffusers", diffusers_classes, dcases))
    except ImportError:
        pass
    try:
        import transformers  # noqa: F401
        from .transformers_cases import CASES as tcases
        libs.append(("transformers", transformers_classes, tcases))
    except ImportError:
        pass
    return libs


def rows(only: set[str] | None = None, progress: Callable[[str], None] | None = None,
         n: int | None = None) -> list[Row]:
    """Every class's rows (one per case, one for a class without a case). ``only``: class or case names to keep."""
    keep = {s.lower() for s in only} if only else None
    todo: list[tuple[str, type, str, list[Case]]] = []
    for lib, classes, cases in _libraries():
        by_cls = _case_classes(cases)
        for cls, where in classes():
            mine = by_cls.get(cls, [])
            if keep is not None and cls.__name__.lower() not in keep:
                mine = [c for c in mine if c.name.lower() in keep]   # named by its case: those cases only
                if not mine:
                    continue
            todo.append((lib, cls, where, mine))
    out: list[Row] = []
    for i, (lib, cls, where, mine) in enumerate(todo, 1):
        start = time.perf_counter()
        made = [Row(lib, cls.__name__, where, c.name, run_case(c, n or ROWS[lib]), c.note) for c in mine] \
            or [Row(lib, cls.__name__, where)]
        out += made
        if progress is not None:
            progress(f"[{i}/{len(todo)}] {lib} {cls.__name__}: " + " | ".join(r.outcome.split(";")[0] for r in made)
                     + f"  ({time.perf_counter() - start:.1f} s)")
    return out


def _kind(outcome: str) -> str:
    for prefix, kind in (("streams", "streams (captured)"), ("hand-written recognizers on parts", "parts only"),
                         ("hand-written", "hand-written recognizer"),
                         ("stays stock", "stays stock"), ("no test case", "no test case yet"), ("error", "error")):
        if outcome.startswith(prefix):
            return kind
    return "other"


def summary(table: list[Row]) -> str:
    classes: dict[tuple[str, str], str] = {}
    order = ["streams (captured)", "hand-written recognizer", "parts only", "stays stock", "error", "no test case yet"]
    for r in table:   # a class counts as its best case
        k = _kind(r.outcome)
        prev = classes.get((r.library, r.cls))
        if prev is None or order.index(k) < order.index(prev):
            classes[(r.library, r.cls)] = k
    parts = []
    for lib in sorted({lib for lib, _ in classes}):
        counts = {k: sum(1 for (l2, _), v in classes.items() if l2 == lib and v == k) for k in order}
        total = sum(counts.values())
        prefer = {c for r in table if r.library == lib and "captured path: streams" in r.outcome
                  for c in [r.cls] if classes[(lib, c)] != "streams (captured)"}
        parts.append(f"{lib}: {total} classes: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
                     + (f" ({len(prefer)} of the others stream with capture=\"prefer\")" if prefer else ""))
    return "; ".join(parts)


def render_text(table: list[Row]) -> str:
    head = ("library", "class", "module", "case", "what happens")
    data = [(r.library, r.cls, _short(r), r.case or "-", r.outcome + (f"  [{r.note}]" if r.note else ""))
            for r in table]
    widths = [max(len(x[i]) for x in [head, *data]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:4], widths)) + "  " + head[4]]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.ljust(w) for c, w in zip(x[:4], widths)) + "  " + x[4] for x in data]
    lines.append("")
    lines.append(summary(table))
    return "\n".join(lines)


def _short(r: Row) -> str:
    """The defining module, without the library's own prefix."""
    for prefix in ("diffusers.models.transformers.", "diffusers.models.", "transformers.models."):
        if r.module.startswith(prefix):
            return r.module[len(prefix):]
    return r.module


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(table: list[Row], n: int | None = None) -> str:
    import platform
    versions = [f"torch {torch.__version__}"]
    for lib in ("diffusers", "transformers"):
        mod = sys.modules.get(lib)
        if mod is not None:
            versions.append(f"{lib} {mod.__version__}")
    lines = [
        "# streamplan coverage",
        "",
        "Generated by `python -m streamplan.tools.catalogue --markdown benchmarks/COVERAGE.md`: do not edit by hand.",
        "",
        f"Every transformer block class of the pinned diffusers and every decoder layer class of {len(FAMILIES)} "
        "transformers causal-LM families (enumerated from the libraries, see `streamplan/tools/catalogue/table.py`), "
        "and what `streamplan.apply` does with it. A class with a test case (`streamplan/catalogue/*_cases.py`: a "
        "tiny random-weight block with the inputs its model hands it) was run on CPU in fp32 at "
        + (f"{n} rows" if n else ", ".join(f"{v} rows ({k})" for k, v in ROWS.items())) + " in "
        f"chunks of {CHUNK}: with the defaults, and when they did not take the captured-graph path, again "
        "with `capture=\"prefer\"` (\"captured path: ...\"); \"parts only\": hand-written recognizers took some "
        "of the block's children (norms, MLP) and the rest ran stock. \"exact to\" is the largest difference from "
        "the class's own forward, relative to the output's largest magnitude. \"stays stock\" gives the reason the "
        "report gives.",
        "",
        f"Versions: {', '.join(versions)}; {platform.machine()} CPU.",
        "",
        f"Summary: {summary(table)}.",
        "",
        "| library | class | module | case | what happens | case note |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(f"| {r.library} | `{r.cls}` | {_short(r)} | {r.case or '-'} | {_md(r.outcome)} | {_md(r.note)} |")
    return "\n".join(lines) + "\n"
