"""The handle's report, as text and JSON: what streamed (a line per input signature, with its plan) and what was
left stock and why."""
from __future__ import annotations

import json

from .plan.budget import fmt_bytes
from .specs import GraphSpec
from .plan.planner import Tier
from .execute.stock_watch import StockWatch, matters

STOCK_WHY = "runs stock (streamplan streams no structure here)"


def _shown(shape) -> bool:
    """A shape worth showing: a tensor's, or a tuple holding one (plain values a call passes show as None)."""
    if isinstance(shape, tuple) and shape and not isinstance(shape[0], int):
        return any(_shown(x) for x in shape)
    return shape is not None


def describe_sig(sig: tuple) -> str:
    shapes = sig[0]
    if shapes and isinstance(shapes[0], int):
        text = str(list(shapes))
    else:
        named = lambda s: isinstance(s, tuple) and s and isinstance(s[0], str)  # noqa: E731 -- (keyword, shape)
        text = ", ".join(f"{s[0]}={s[1]}" if named(s) else str(s) for s in shapes
                         if _shown(s[1] if named(s) else s))
    return f"{text} {str(sig[1]).replace('torch.', '')}"


def stock_that_matters(handle) -> list[StockWatch]:
    largest = max((p.predicted_peak for plans in handle.plans.values() for p in plans), default=0)
    return [w for w in handle.watched.values() if matters(w, largest)]


def _inside(name: str, parent: str) -> bool:
    return name != parent and (not parent or name.startswith(parent + "."))


def to_json(handle) -> str:
    return json.dumps({
        "streamed": {n: {"class": type(e.module).__name__, "recognized_as": e.spec.label,
                         "plans": [{"shape": repr(s[0]), "dtype": str(s[1]), **p.to_dict(),
                                    **({"kv_error": vars(e.kv_errors[s])} if s in e.kv_errors else {})}
                                   for s, p in e.plans.items()]}
                     for n, e in handle.installed.items()},
        "stock": [{"name": s.name, "class": s.cls, "reason": s.reason} for s in handle.skipped]
                 + [{"name": w.name, "class": type(w.module).__name__, "reason": STOCK_WHY,
                     "input_shape": list(w.shape or ()), "output_bytes": w.largest, "live_bytes": w.live}
                    for w in stock_that_matters(handle)],
    }, indent=2)


def _budget_line(o) -> str:
    """What the plans were held to: a budget, or none where ``chunk_tokens`` fixed the chunks."""
    if o.chunk_tokens and o.budget in (None, "auto"):
        return f"  budget: none: fixed chunks of {o.chunk_tokens} rows (chunk_tokens)"
    if o.budget is None:
        return "  budget: none"
    b = "auto" if o.budget == "auto" else fmt_bytes(o.budget)
    held = f"  budget: {b}" + (f" (the free device memory less a reserve of {fmt_bytes(o.reserve)})"
                               if o.budget == "auto" else "")
    return held + (f"; chunks fixed at {o.chunk_tokens} rows (chunk_tokens)" if o.chunk_tokens else "")


def render(handle) -> str:
    root = type(handle.root).__name__
    lines = [f"streamplan report for {root}"]
    lines.append(_budget_line(handle.options))
    if handle.superseded_by is not None:
        lines.append("  superseded by a later streamplan.apply on these modules: that handle's report is current")
    elif handle.removed:
        lines.append("  handle removed: the model runs its stock forwards")
    if not handle.installed and not handle.removed:
        lines.append(f"  nothing recognised in {root}: the model is untouched")
    nw = max([len(n or "<root>") for n in handle.installed] + [6])
    lw = max([len(e.spec.label) for e in handle.installed.values()] + [2])
    if handle.installed:
        header = (f"  {'module':<{nw}} {'as':<{lw}} {'tier':<4} {'chunk':>6} {'ffn':>6} {'predicted':>11} "
                  f"{'stock est.':>11} {'time':>6}")
        lines += [header, "  " + "-" * (len(header) - 2)]
    graphs = [n for n, e in handle.installed.items() if isinstance(e.spec, GraphSpec)]
    for name, e in handle.installed.items():
        label = e.spec.label
        if not e.plans and not e.runtime_notes and any(_inside(name, g) for g in graphs):
            continue   # a block's part, idle while its graph takes every call: the block's label says so
        if not e.plans:
            ran_stock = any(n.startswith("ran stock") for n in e.runtime_notes)
            lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} "
                         + ("stock (not planned: see the note)" if ran_stock
                            else "(not called yet: planned at the first call)"))
        for sig, plan in e.plans.items():
            if plan.note and not plan.predicted_peak:   # a plan of no figures of its own (a model forward's)
                lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} {plan.tier:<4} {plan.note}")
                continue
            ffn = str(plan.ffn_slice) if plan.tier == Tier.L2 else "-"
            chunk = str(plan.chunk) if plan.tier != Tier.L0 and plan.chunk else "-"
            lines.append(f"  {name or '<root>':<{nw}} {label:<{lw}} {plan.tier:<4} {chunk:>6} {ffn:>6} "
                         f"{fmt_bytes(plan.predicted_total):>11} "
                         f"{fmt_bytes(plan.live_bytes + plan.stock_peak):>11} {_time(plan):>6}")
            lines.append(f"      input {describe_sig(sig)}: {plan.describe(figures=False)}")
            if host_bound(plan):
                lines.append(f"      {host_bound_said(plan)}")
            if sig in e.kv_errors:
                lines.append(f"      {e.kv_errors[sig].describe()}")
        for note in e.runtime_notes:
            lines.append(f"      note: {note}")
    if handle.installed:
        lines.append("  (predicted and stock est.: the call's peak bytes with its live inputs counted, as a budget "
                     "holds them; from the memory model, not measured: streamplan.measure_peak measures a call, "
                     "handle.timeline() draws both; time: the time model's call time against stock's, on the "
                     "device's fitted rates, '-' where none are fitted (the CPU))")
        used = sorted({str(p.tier) for e in handle.installed.values() for p in e.plans.values()})
        if used:
            lines.append("  tiers: " + "; ".join(f"{t} {Tier(t).meaning}" for t in used))
    for check in getattr(handle, "checks", ()):
        lines.append(f"  check: {check}")
    for s in handle.skipped:
        lines.append(f"  stock     {s.name or '<root>'}  ({s.cls}): {s.reason}")
    for w in stock_that_matters(handle):
        lines.append(f"  stock     {w.name}  ({type(w.module).__name__}): {STOCK_WHY}; output "
                     f"{fmt_bytes(w.largest)} for input {list(w.shape or ())} (+{fmt_bytes(w.live)} live inputs)")
    return "\n".join(lines)


# a plan whose predicted time is at least this share the host dispatching is said to be bound by the host
HOST_BOUND = 0.5


def host_bound(plan) -> bool:
    """Whether the time model has most of ``plan``'s time as the host dispatching (``Plan.predicted_host_share``)."""
    return (plan.predicted_host_share or 0.0) >= HOST_BOUND


def host_bound_said(plan) -> str:
    """What a host-bound plan's time depends on, for reports and logs."""
    return (f"host-bound: {plan.predicted_host_share:.0%} of the predicted time is the host dispatching (each "
            f"chunk's ops, a K/V store's block steps); on a slower host CPU this plan takes longer (a larger budget, "
            f"or longer chunks, needs fewer steps)")


def _time(plan) -> str:
    return "-" if plan.predicted_time_ratio is None else f"{plan.predicted_time_ratio:.2f}x"
