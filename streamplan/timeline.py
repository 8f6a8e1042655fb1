"""The memory picture of a model's last call (``StreamHandle.timeline``, ``streamplan demo --plot``, ``streamplan
bench --plot``): a row per streamed module call, in call order, with the planner's predicted peak and what it is
made of (the call's inputs, K/V, whole buffers such as the residual's next value, a chunk's transient), the stock
estimate, and the peaks the meter measured for the call and for each of its phases (phase KV, phase Q, a self-check's
stock run) where the call ran under the profiler-based meter. Written as one self-contained HTML file: inline SVG and
a table of the same figures, no script, nothing fetched, so it opens anywhere and can be mailed.

Every figure stands on one baseline: bytes of the call with its inputs, weights not counted (what a budget holds).
Measured figures are the meter's (``meter.range_peak``: a call's peak above what was live when it began) plus the
call's inputs; the whole call's measured peak is what ``measure_peak`` returned, plus the model call's inputs."""
from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .meter import range_peak
from .plan.budget import fmt_bytes

__all__ = ["Timeline", "CallRow", "PhaseRow", "from_handle", "render_html", "write_html"]


@dataclass
class PhaseRow:
    """A phase of a call as the meter saw it: ``own`` bytes above what was live when the call began (None: not
    measured)."""

    name: str
    own: int | None = None


@dataclass
class CallRow:
    """One streamed module call: its plan's figures (predicted, with inputs) and the meter's (``own``: the peak above
    what was live when it began; ``measured`` adds its inputs)."""

    name: str                     # the module's name in the model ("<root>": the model itself)
    cls: str
    depth: int                    # streamed calls it ran inside
    tier: str                     # "L1", ... ; "stock" where it ran its own forward unplanned
    detail: str                   # the plan in one line (no figures)
    inputs: int                   # the call's inputs: the baseline every figure of the row stands on
    kv: int | None = None         # predicted parts above the inputs (None: the plan does not break its peak down)
    held: int | None = None
    transient: int | None = None
    predicted: int | None = None  # the planner's peak with the inputs (the report's "predicted")
    stock_est: int | None = None  # the planner's estimate of stock's peak with the inputs
    own: int | None = None        # measured: the meter's peak above what was live when the call began
    seconds: float = 0.0          # wall time, host clock
    phases: list[PhaseRow] = field(default_factory=list)

    @property
    def measured(self) -> int | None:
        return None if self.own is None else self.inputs + self.own


@dataclass
class Timeline:
    """What a memory picture shows: the call rows, and the whole call's measured peak (``call_own``: what
    ``measure_peak`` returned for it) and stock's (``stock_own``, when given), both above what was live when they
    were measured; ``call_inputs`` puts them on the rows' baseline."""

    title: str
    rows: list[CallRow]
    call_inputs: int = 0
    call_own: int | None = None
    stock_own: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def call_measured(self) -> int | None:
        return None if self.call_own is None else self.call_inputs + self.call_own

    @property
    def stock_measured(self) -> int | None:
        return None if self.stock_own is None else self.call_inputs + self.stock_own

    def to_dict(self) -> dict:
        return {**asdict(self), "call_measured": self.call_measured, "stock_measured": self.stock_measured}


def from_handle(handle: Any, *, stock_peak: int | None = None, title: str = "") -> Timeline:
    """The picture of ``handle``'s last call, from its ledger (``handle.calls``) and what the meter recorded."""
    rows, call_own = [], None
    for rec in handle.calls:
        plan = rec.plan
        seen = range_peak(rec.tag)
        if seen is not None:
            call_own = seen.call_peak
        phases = []
        for name in rec.phases:
            p = range_peak(f"{rec.tag}/{name}")
            phases.append(PhaseRow(name, None if p is None or seen is None else p.peak - seen.start))
        row = CallRow(rec.name or "<root>", rec.cls, rec.depth, "stock", "ran its own forward (no plan)",
                      rec.inputs, own=None if seen is None else seen.own, seconds=rec.seconds, phases=phases)
        if plan is not None:
            row.tier, row.detail = str(plan.tier), plan.describe(figures=False)
            row.inputs = plan.live_bytes or rec.inputs
            if plan.predicted_peak or not plan.note:
                row.predicted = plan.live_bytes + plan.predicted_peak
                row.stock_est = plan.live_bytes + plan.stock_peak
            if plan.parts is not None:
                row.kv, row.held, row.transient = plan.parts.kv, plan.parts.held, plan.parts.transient
        rows.append(row)
    notes = []
    if not rows:
        notes.append("no streamed call recorded: call the model (after streamplan.apply) before asking for its "
                     "timeline")
    elif call_own is None:
        notes.append("not measured: run the call inside streamplan.measure_peak (CPU) or meter.profiler_peak "
                     "(CUDA) to see measured peaks beside the predicted ones")
    root = type(handle.root).__name__
    return Timeline(title or f"streamplan memory timeline: {root}, its last call", rows, handle.call_inputs,
                    call_own, stock_peak, notes)


# --- rendering -----------------------------------------------------------------------------------------------------

COLOURS = {"inputs": "#bab0ac", "kv": "#4e79a7", "held": "#59a14f", "transient": "#f28e2b", "predicted": "#9c755f",
           "measured": "#222222", "stock": "#e15759", "phase KV": "#76b7b2", "phase Q": "#b07aa1",
           "phase KV + attention": "#76b7b2", "self-check: stock": "#ff9da7"}
PARTS = (("inputs", "the call's inputs"), ("kv", "K/V kept between the phases"),
         ("held", "whole buffers: outputs (the residual's next value), an attention output built ahead"),
         ("transient", "one chunk's transient"))
LABEL_W, BAR_W, ROW_H, TOP = 300, 620, 46, 96
TEXT_W = 110   # room right of the longest bar for its figure


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _mib(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def _short(n: float) -> str:
    """An axis tick: ``50 MiB``, ``1.5 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def _scale(timelines: Iterable[Timeline]) -> float:
    """The largest figure drawn, rounded up to a tick."""
    most = 1
    for t in timelines:
        for r in t.rows:
            most = max([most, r.inputs] + [v for v in (r.predicted, r.stock_est, r.measured) if v is not None]
                       + [r.inputs + p.own for p in r.phases if p.own is not None])
        most = max([most] + [v for v in (t.call_measured, t.stock_measured) if v is not None])
    step = _tick(most)
    return math.ceil(most / step) * step


def _tick(most: float) -> float:
    """A step of 1, 2 or 5 times a power of ten of the unit the largest figure is written in (B, KiB, MiB, GiB), about
    six steps to the largest."""
    unit = next((size for size in (2**30, 2**20, 2**10) if most >= size), 1)
    raw = most / unit / 6
    base = 10 ** math.floor(math.log10(max(raw, 1e-9)))
    step = next(m * base for m in (1, 2, 5, 10) if raw <= m * base)
    return step * unit


def _data(r: CallRow) -> str:
    """A row's figures in bytes, as attributes (what a program reading the file compares; the text rounds them)."""
    figures = {"inputs": r.inputs, "kv": r.kv, "held": r.held, "transient": r.transient, "predicted": r.predicted,
               "stock-est": r.stock_est, "own": r.own, "measured": r.measured}
    return "".join(f' data-{k}="{v}"' for k, v in figures.items() if v is not None)


def _rect(x: float, y: float, w: float, h: float, colour: str, tip: str, extra: str = "") -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h:.1f}" fill="{colour}"{extra}>'
            f"<title>{_e(tip)}</title></rect>")


def _svg(t: Timeline, most: float) -> str:
    x0 = LABEL_W
    px = (BAR_W - TEXT_W) / most
    n = len(t.rows) + 1
    height = TOP + n * ROW_H + 30
    width = LABEL_W + BAR_W + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f"<title>{_e(t.title)}</title>"]
    # legend
    lx, ly = 8, 14
    for key, words in PARTS:
        out.append(_rect(lx, ly - 9, 12, 10, COLOURS[key], words))
        out.append(f'<text x="{lx + 16}" y="{ly}">{_e(words.split(":")[0])}</text>')
        lx += 30 + 6 * len(words.split(":")[0])
    lx, ly = 8, 32
    for key, words in (("predicted", "predicted, not broken down"), ("measured", "measured peak (meter)"),
                       ("phase KV", "measured: phase KV"),
                       ("phase Q", "measured: phase Q"), ("stock", "stock: estimate (dashed), measured (solid)")):
        out.append(_rect(lx, ly - 7, 12, 5, COLOURS[key], words))
        out.append(f'<text x="{lx + 16}" y="{ly}">{_e(words)}</text>')
        lx += 30 + 6 * len(words)
    out.append('<text x="8" y="52" font-style="italic">bytes of each call with its inputs (what a budget holds); '
               'weights not counted</text>')
    # axis and grid
    step = _tick(most)
    axis_y = TOP - 12
    v = 0.0
    while v <= most + 1:
        x = x0 + v * px
        out.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{height - 24}" stroke="#dddddd"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y - 4}" text-anchor="middle">{_e(_short(v))}</text>')
        v += step
    y = TOP
    for r in t.rows:
        indent = 10 * r.depth
        label = f"{r.name}  {r.tier}" + (f" ({r.cls})" if r.depth == 0 else "")
        out.append(f'<g class="call" data-name="{_e(r.name)}"{_data(r)}>')
        out.append(f'<text x="{8 + indent}" y="{y + 12}">{_e(label[:48])}<title>{_e(r.cls)}: '
                   f"{_e(r.detail)}</title></text>")
        if r.predicted is not None:
            bx, bh = x0, 12
            parts = [("inputs", r.inputs)]
            if r.kv is not None:
                parts += [("kv", r.kv), ("held", r.held), ("transient", r.transient)]
            else:
                parts += [("predicted", r.predicted - r.inputs)]
            for key, size in parts:
                if size:
                    words = dict(PARTS).get(key, "predicted peak above the inputs")
                    out.append(_rect(bx, y + 2, size * px, bh, COLOURS[key], f"predicted, {words}: {fmt_bytes(size)}"))
                    bx += size * px
            out.append(f'<text x="{bx + 4:.1f}" y="{y + 12}" fill="#555555">predicted '
                       f"{_e(_short(r.predicted))}</text>")
        else:
            out.append(_rect(x0, y + 2, r.inputs * px, 12, COLOURS["inputs"], f"inputs: {fmt_bytes(r.inputs)}"))
        if r.stock_est is not None:
            sx = x0 + r.stock_est * px
            out.append(f'<line x1="{sx:.1f}" y1="{y}" x2="{sx:.1f}" y2="{y + 30}" stroke="{COLOURS["stock"]}" '
                       f'stroke-width="2" stroke-dasharray="4 3"><title>stock, estimated by the planner: '
                       f"{_e(fmt_bytes(r.stock_est))}</title></line>")
        if r.measured is not None:
            out.append(_rect(x0, y + 17, r.measured * px, 4, COLOURS["measured"],
                             f"measured peak: {fmt_bytes(r.measured)} ({fmt_bytes(r.own)} above what was live when "
                             f"it began, plus its inputs)"))
            out.append(f'<text x="{x0 + r.measured * px + 4:.1f}" y="{y + 22}" font-size="9">measured '
                       f"{_e(_short(r.measured))}</text>")
        for i, p in enumerate(ph for ph in r.phases if ph.own is not None):
            w = (r.inputs + p.own) * px
            out.append(_rect(x0, y + 25 + 6 * i, w, 3, COLOURS.get(p.name, "#888888"),
                             f"measured, {p.name}: {fmt_bytes(r.inputs + p.own)}"))
            out.append(f'<text x="{x0 + w + 4:.1f}" y="{y + 29 + 6 * i}" font-size="8" fill="#555555">'
                       f"{_e(p.name)} {_e(_short(r.inputs + p.own))}</text>")
        out.append("</g>")
        y += ROW_H
    # the whole call
    out.append(f'<g class="whole-call" data-inputs="{t.call_inputs}"'
               + (f' data-own="{t.call_own}" data-measured="{t.call_measured}"' if t.call_own is not None else "")
               + (f' data-stock-measured="{t.stock_measured}"' if t.stock_own is not None else "") + ">")
    out.append(f'<text x="8" y="{y + 12}" font-weight="bold">the whole call (measured)</text>')
    if t.call_measured is not None:
        out.append(_rect(x0, y + 4, t.call_measured * px, 8, COLOURS["measured"],
                         f"streamed, measured: {fmt_bytes(t.call_measured)}"))
        out.append(f'<text x="{x0 + t.call_measured * px + 4:.1f}" y="{y + 12}">streamed '
                   f"{_e(_short(t.call_measured))}</text>")
    if t.stock_measured is not None:
        out.append(_rect(x0, y + 16, t.stock_measured * px, 8, COLOURS["stock"],
                         f"stock, measured: {fmt_bytes(t.stock_measured)}"))
        out.append(f'<text x="{x0 + t.stock_measured * px + 4:.1f}" y="{y + 24}">stock '
                   f"{_e(_short(t.stock_measured))}</text>")
    out.append("</g></svg>")
    return "\n".join(out)


def _table(t: Timeline) -> str:
    head = ("module", "tier", "plan", "inputs", "K/V", "whole buffers", "transient", "predicted", "stock est.",
            "measured", "phases measured", "wall s")
    lines = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for r in t.rows:
        phases = "; ".join(f"{p.name} {_mib(None if p.own is None else r.inputs + p.own)}" for p in r.phases) or "-"
        cells = ("&#160;" * 2 * r.depth + _e(r.name), _e(r.tier), _e(r.detail), _mib(r.inputs), _mib(r.kv),
                 _mib(r.held), _mib(r.transient), _mib(r.predicted), _mib(r.stock_est), _mib(r.measured),
                 _e(phases), f"{r.seconds:.3f}")
        lines.append('<tr class="call">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _section(t: Timeline, most: float) -> str:
    summary = []
    if t.call_measured is not None:
        summary.append(f"measured peak of the whole call: {fmt_bytes(t.call_measured)} with its inputs "
                       f"({fmt_bytes(t.call_own)} above what was live when it was measured: what "
                       f"streamplan.measure_peak returned)")
    if t.stock_measured is not None:
        summary.append(f"stock's measured peak for the same call: {fmt_bytes(t.stock_measured)} with its inputs")
    if t.call_measured and t.stock_measured:
        summary.append(f"{t.stock_measured / t.call_measured:.2f}x less peak memory streamed (measured)")
    parts = [f"<h2>{_e(t.title)}</h2>"]
    parts += [f"<p>{_e(s)}</p>" for s in summary + t.notes]
    parts += [_svg(t, most), _table(t)]
    return '<div class="timeline">\n' + "\n".join(parts) + "\n</div>"


STYLE = ("body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;font-size:12px;"
         "margin:8px 0 24px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child,"
         "td:nth-child(2),td:nth-child(3),th{text-align:left}p{margin:4px 0}")

LEGEND = ("Each row is one streamed module call of the model's last call, in call order (nested calls indented). "
          "The thick bar is the planner's predicted peak, split into what it holds: the call's inputs, K/V kept "
          "between its phases, whole buffers (its outputs: the residual stream's next value; an attention output "
          "built ahead), and one chunk's transient. Under it, the peak the meter measured for the call (black) and "
          "for each phase (coloured). The red dashed line is the planner's estimate of stock's peak for the same "
          "call. Hover a shape for its figure; the table below has them all.")


def render_html(timelines: list[Timeline]) -> str:
    """One self-contained XHTML page (inline SVG and tables; no script, no external file) for ``timelines``,
    drawn to one scale."""
    most = _scale(timelines)
    title = timelines[0].title if len(timelines) == 1 else "streamplan memory timeline"
    body = "\n".join(_section(t, most) for t in timelines)
    return ("<!DOCTYPE html>\n"
            '<html xmlns="http://www.w3.org/1999/xhtml" lang="en">\n'
            f'<head><meta charset="utf-8"/><title>{_e(title)}</title><style>{STYLE}</style></head>\n'
            f"<body>\n<p>{_e(LEGEND)}</p>\n{body}\n</body>\n</html>\n")


def write_html(timelines: list[Timeline], path: str | Path) -> Path:
    """``render_html`` written to ``path`` (its folder made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(timelines), encoding="utf-8")
    return path
