"""Blocks that cut their rows at a fixed count and join them back (``graph.fixed_row_slices``): HunyuanVideo I2V's
first-frame rows with their own modulation (``x[:, :num_tokens]`` / ``x[:, num_tokens:]``) and Helios' history rows
split off before the cross-attention (``split_with_sizes``). Each streams on the captured path, against diffusers'
own forward, with chunks that straddle the cut and chunks that hold none of one side; what is not a cut at a fixed
count joined back stays stock, named."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamplan
from conftest import rel_err, streamed

pytest.importorskip("diffusers")

from streamplan.tools.catalogue.diffusers_cases import CASES, _r, _txt, _x  # noqa: E402

CPU = torch.device("cpu")
F32 = torch.float32


def _hunyuan(name: str, rows: int, num_tokens: int):
    case = CASES[name]
    block = case.build().eval()
    args, kwargs = case.inputs(rows, CPU, F32)
    return block, args, {**kwargs, "num_tokens": num_tokens}


def _helios(rows: int, current: int):
    """Helios' block with ``rows - current`` history rows (their own t=0 modulation, no cross-attention) first."""
    block = CASES["helios"].build().eval()
    history = rows - current
    temb = torch.cat([_r(1, 1, 6, 64, device=CPU, dtype=F32).expand(1, history, 6, 64),
                      _r(1, 1, 6, 64, device=CPU, dtype=F32).expand(1, current, 6, 64)], dim=1)
    return block, (_x(rows, CPU, F32), _txt(CPU, F32), temb, _r(1, rows, 32, device=CPU, dtype=F32), current), {}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _cuts_seen(monkeypatch) -> list:
    """Each chunk's part of each side, as the executor cut it: (chunk start, rows per side)."""
    import streamplan.execute.graph_run as graph_run
    seen, run_cut = [], graph_run.run_cut

    def spy(cut, x, rows, a, dynamic_only, symbol):
        parts = run_cut(cut, x, rows, a, dynamic_only, symbol)
        seen.append((a, [p.shape[cut.dim] for p in (parts if isinstance(parts, list) else [parts])]))
        return parts
    monkeypatch.setattr(graph_run, "run_cut", spy)
    return seen


# (case, rows, the fixed count, chunk, the fewest rows the capture holds for): one chunk across the cut, others with
# none of one side. The capture is retried from the count past the cut + 1 that export's guard names (the single
# block's 7 text rows count towards it), or from MIN_ROWS_RETRY where the call has 512 rows and that is enough
SETUPS = [
    ("hunyuan_video_i2v_single", 480, 40, 64, 35),
    ("hunyuan_video_i2v_single", 480, 40, 100, 35),
    ("hunyuan_video_i2v_single", 1024, 300, 128, 295),
    ("hunyuan_video_i2v_double", 480, 40, 64, 42),
    ("hunyuan_video_i2v_double", 1024, 90, 64, 256),
    ("helios", 480, 60, 96, 62),
    ("helios", 1024, 100, 128, 256),
]


@pytest.mark.parametrize("name, rows, count, chunk, least", SETUPS)
@torch.no_grad()
def test_a_block_cutting_its_rows_at_a_fixed_count_streams_exactly(name, rows, count, chunk, least, monkeypatch):
    from streamplan.graph import streamable
    torch.manual_seed(0)
    block, args, kwargs = _helios(rows, count) if name == "helios" else _hunyuan(name, rows, count)
    ref, stock_peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
    seen = _cuts_seen(monkeypatch)
    with streamed(block, chunk_tokens=chunk, capture="prefer") as handle:
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=CPU)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1" and plan.rows == rows, handle.report()
        assert "captured" in handle.report()
        assert streamable(block, args, kwargs, rows)[0].captured.min_rows == least
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert o.shape == r.shape and rel_err(o, r) <= 1e-5, rel_err(o, r)
    assert peak < stock_peak, (peak, stock_peak)
    # the cut ran per chunk: some chunk held rows of every side (across the cut), some none of one side
    starts = {a for a, _ in seen}
    assert len(starts) > 2
    assert starts - {a for a, sides in seen if 0 in sides}
    assert any(0 in sides for _, sides in seen)


@torch.no_grad()
def test_each_chunk_takes_its_part_of_either_side_re_based_to_it():
    """The cut's bounds are the call's (40 first-frame rows of 300, then 7 text rows): the first chunk of 64 holds the
    40 and 24 others (with the text rows, as a first chunk of a block with static rows does), a later one holds none
    of the 40 and all its rows on the other side."""
    from streamplan.graph import streamable
    from streamplan.graph.fixed_row_slices import run_cut
    torch.manual_seed(0)
    block, args, kwargs = _hunyuan("hunyuan_video_i2v_single", 300, 40)
    found, _ = streamable(block, args, kwargs, 300)
    an, sym = found.analysis, found.captured.row_symbol
    assert an.fixed_cuts and an.fixed_joins
    assert found.captured.min_rows > 2   # the capture holds from where the rows past the cut exist
    head = next(c for c in an.fixed_cuts.values() if c.dim == 1 and str(c.spans[0]) == "(0, 40)")
    tail = next(c for c in an.fixed_cuts.values() if c.dim == 1 and str(c.spans[0][0]) == "40")
    x = torch.arange(307.0).view(1, -1, 1)           # the call's rows, then its 7 text rows
    first = torch.cat([x[:, :64], x[:, 300:]], 1)    # chunk [0, 64) as the first chunk holds it
    assert run_cut(head, first, 300, 0, False, sym).flatten().tolist() == list(range(40))
    assert run_cut(tail, first, 300, 0, False, sym).flatten().tolist() == list(range(40, 64)) + list(range(300, 307))
    later = x[:, 64:128]                             # a later chunk: its dynamic rows alone
    assert run_cut(head, later, 300, 64, True, sym).shape[1] == 0
    assert run_cut(tail, later, 300, 64, True, sym).flatten().tolist() == list(range(64, 128))


class _Cut(nn.Module):
    """Attention between projections, its first ``n`` rows scaled apart and joined back; ``how`` bends the cut."""

    def __init__(self, how: str, n: int = 20):
        super().__init__()
        self.how, self.n = how, n
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.count = nn.Parameter(torch.tensor(float(n)), requires_grad=False)

    def forward(self, x):
        b, rows, d = x.shape
        n = self.n
        if self.how == "half":
            n = rows // 2   # a bound that moves with the row count: not a fixed count
        if self.how == "data":
            n = int(self.count.item())   # a bound read off the data
        if self.how == "reshape":
            head = x[:, :n].reshape(b, n * 2, d // 2).reshape(b, n, d) * 2.0
        else:
            head = x[:, :n] * 2.0
        h = torch.cat([head, x[:, n:]], dim=1)
        q, k, v = self.qkv(h).view(b, rows, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, rows, d)
        if self.how == "alone":   # one side handed out without the rest
            return x + self.out(o), head
        return x + self.out(o)


@torch.no_grad()
def test_the_small_cut_block_streams():
    block = _Cut("plain").eval()
    x = torch.randn(1, 300, 32)
    ref = block(x)
    with streamed(block, chunk_tokens=64, capture="prefer") as handle:
        out = block(x)
        assert handle.plans[""][0].tier == "L1", handle.report()
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("how, reason", [
    ("half", "capture failed"),                    # a bound that moves with the row count: export's guard refuses
    ("data", "capture failed"),                    # a bound read off the data: export refuses it
    ("reshape", "rows cut at a fixed count"),
    ("alone", "an output holds rows cut at a fixed count"),
])
@torch.no_grad()
def test_what_is_not_a_cut_at_a_fixed_count_joined_back_stays_stock_and_says_why(how, reason):
    block = _Cut(how).eval()
    x = torch.randn(1, 300, 32)
    ref = block(x)
    with streamed(block, chunk_tokens=64, capture="prefer") as handle:
        out = block(x)
        report = handle.report()
        assert not [p for p in handle.plans.get("", []) if p.tier != "L0"], report
        assert "ran stock" in report or "stays stock" in report or "stock" in report, report
        assert reason in report, report
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(o, r)


def test_only_constants_and_the_row_count_plus_a_constant_are_fixed_bounds():
    import sympy
    from streamplan.graph.fixed_row_slices import _affine
    s, u = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("u0", integer=True)
    assert _affine(sympy.Integer(20), s) and _affine(s - 352, s) and _affine(s + 7, s)
    assert not _affine(sympy.floor(s / 2), s) and not _affine(2 * s, s) and not _affine(u, s) and not _affine(s - u, s)


@torch.no_grad()
def test_a_call_with_fewer_rows_than_its_capture_holds_for_runs_stock():
    """A capture valid from num_tokens + 2 rows, reused by a call with fewer rows: stock, named."""
    torch.manual_seed(0)
    case = CASES["hunyuan_video_i2v_double"]
    block = case.build().eval()
    (args, kwargs), (small, small_kw) = (case.inputs(n, CPU, F32) for n in (300, 20))
    kwargs, small_kw = {**kwargs, "num_tokens": 40}, {**small_kw, "num_tokens": 25}
    ref = block(*small, **small_kw)
    with streamed(block, chunk_tokens=64, capture="prefer") as handle:
        block(*args, **{**kwargs, "num_tokens": 25})
        out = block(*small, **small_kw)
        assert "fewer than the" in handle.report(), handle.report()
    assert torch.equal(_first(out), _first(ref))
