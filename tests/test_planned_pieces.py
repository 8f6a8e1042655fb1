"""Row pieces chosen by the planner (issue 32): where a captured block has row-local runs and the user left
``row_pieces`` unset, the planner prices each count in ``ROW_PIECES`` by the memory model (``graph_memory(...,
pieces)``, as the executor's run is priced) and by the time model (each piece launches its runs' ops again), and takes
the fastest legal plan; on the CPU (no fitted rates) pieces come before head groups where whole chunks do not fit."""
import json
from dataclasses import replace

import pytest
import torch

import streamplan
import streamplan.plan.planner as planner
from streamplan.api import PLAN_MARGIN
from streamplan.graph.work import BlockWork
from streamplan.plan.planner import Costs, plan_graph
from streamplan.plan.time_model import RATES, Streamed, pieces_seconds, streamed_seconds
from streamplan.tools.families import FAMILIES, on_meta

H200 = RATES["meta"]


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor))


def _planned(module, args, kwargs=None, **options):
    """The root plan and the handle's report and JSON, planned by one call (the handle removed after)."""
    handle = streamplan.apply(module, capture="prefer", **options)
    try:
        with torch.inference_mode():
            module(*args, **(kwargs or {}))
        return handle.plans[""][-1], handle.report(), handle.to_json()
    finally:
        handle.remove()


# -- the real-width LTX-2 block on meta -----------------------------------------------------------------------------

LTX2_ROWS = 206040


@pytest.fixture(scope="module")
def ltx2_planned():
    """The LTX-2 block at 206,040 rows under its inputs + 1.15x its floor, every candidate the planner priced
    recorded."""
    fam = FAMILIES["ltx2-block"]
    module, inputs = on_meta(fam, LTX2_ROWS, torch.bfloat16)
    budget = int(_nbytes(inputs) + 1.15 * fam.floor_bytes_per_token(torch.bfloat16) * LTX2_ROWS)
    seen = []
    candidates = planner._candidates

    def recording(request, floor):
        plans = candidates(request, floor)
        seen.append((request, list(plans)))
        return plans

    mp = pytest.MonkeyPatch()
    mp.setattr(planner, "_candidates", recording)
    try:
        plan, report, js = _planned(module, inputs, budget=budget)
    finally:
        mp.undo()
    return module, inputs, plan, report, js, seen


def test_meta_ltx2_takes_the_fastest_legal_plan(ltx2_planned):
    """One search per piece count: the audio's attention over the video rows is reduced over the chunks, so nothing
    runs the video self-attention twice and nothing is kept for it (once, two searches: rerun and kept). With the
    per-row tables made piece by piece the video K/V fit whole on the card under 1.15x the floor (they were staged in
    host memory). Every candidate within the budget, each priced with its own piece count, and the plan the fastest of
    them by the time model: pieces, where they lower a chunk's worst moment, launch more than the rows buy."""
    _, _, plan, report, _, seen = ltx2_planned
    assert seen, "the planner did not search candidates"
    base = seen[0][0]
    assert base.pieces == planner.ROW_PIECES and base.row_pieces == 1
    # a piece count is searched where it lowers a chunk's worst moment (whole MLP or its narrowest slice): here the
    # values written over their operands and made late (nothing in place in pieces) leave a whole chunk lower
    probe = min(base.rows, planner.DEFAULT_CHUNK_TOKENS)
    lower = {p for p in base.pieces if any(base.with_pieces(p).transient(probe, sl) < base.transient(probe, sl)
                                           for sl in (0, planner.MIN_FFN_SLICE))}
    assert {r.row_pieces for r, _ in seen} == {1} | lower and len({r.fixed for r, _ in seen}) == 1
    legal = [(r, p) for r, plans in seen for p in plans]
    assert legal and all(p.predicted_peak <= r.budget and p.row_pieces == r.row_pieces for r, p in legal)
    on_card = [r.time_ratio(p) for r, p in legal if p.kv == "device"]
    assert plan.predicted_time_ratio == pytest.approx(min(on_card), rel=1e-12), report
    # a host store is priced within STORE_MARGIN of it (0.1% faster): not worth pinning the K/V's host memory
    stored = min(r.time_ratio(p) for r, p in legal if p.kv != "device")
    assert stored * (1 + planner.STORE_MARGIN) > plan.predicted_time_ratio, (stored, report)
    assert plan.kv == "device" and plan.row_pieces == 1 and not plan.kept_outputs, plan.describe()
    assert plan.predicted_time_ratio < 1.1, plan.describe()
    assert all(r.time_ratio(p) > plan.predicted_time_ratio for r, p in legal if p.row_pieces > 1)
    assert "reduced over the chunks" in report, report


def test_meta_ltx2_forced_pieces_are_carried_and_priced(ltx2_planned):
    module, inputs, free, _, _, _ = ltx2_planned
    plan, report, js = _planned(module, inputs, budget=None, chunk_tokens=8192, row_pieces=8)
    whole, _, _ = _planned(module, inputs, budget=None, chunk_tokens=8192, row_pieces=1)
    assert plan.row_pieces == 8 and whole.row_pieces == 1
    assert "row_pieces=8" in plan.describe() and "row_pieces=8" in report, report
    assert json.loads(js)["streamed"][""]["plans"][-1]["row_pieces"] == 8
    assert plan.to_dict()["row_pieces"] == 8
    assert plan.predicted_time_ratio > whole.predicted_time_ratio   # each piece launches the runs again


# -- the planner itself: pieces chosen where they are the fastest legal plan --------------------------------------

ROWS, KV, OUT = 65536, 2 * 65536 * 4096 * 2, 65536 * 4096 * 2
PER_ROW = {1: 100_000, 2: 60_000, 4: 40_000, 8: 36_000}   # a chunk's transient per row, by row pieces
WORK = BlockWork(rows=ROWS, gemm_flops_row=2.0 * 12 * 4096 * 4096, gemm_flops_static=0.0, gemm_flops_const=0.0,
                 attention_flops=4.0 * ROWS * ROWS * 4096, attention_flops_row=0.0, bytes_row=200_000.0,
                 ops_kv=100, ops_q=150, ops_mlp=0, weight_bytes=0, kv_flops_row=2.0 * 3 * 4096 * 4096,
                 kv_bytes_row=50_000.0, ops_runs=60, ops_piece=8, runs_bytes_row=16_384.0)


def _priced(pieces: int):
    return (lambda c, sl: c * PER_ROW[pieces]), None


def _synthetic(budget: int, **kw):
    """``plan_graph`` on the hand-made block above, and every candidate it priced."""
    plans = []
    candidates = planner._candidates

    def record(request, floor):
        out = candidates(request, floor)
        plans.extend(out)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(planner, "_candidates", record)
    try:
        plan = plan_graph(ROWS, KV + OUT, _priced(1)[0], 10**12, budget=budget, min_chunk=2048, kv=KV,
                          costs=Costs(0.1, "meta", work=WORK, rates=H200), pieces=planner.ROW_PIECES,
                          priced=_priced, **kw)
    finally:
        mp.undo()
    return plan, plans


def test_the_planner_takes_pieces_where_they_are_the_fastest_legal_plan():
    budget = KV + OUT + 100 * 2**20   # whole chunks fit only below the 2,048-row floor; four pieces reach above it
    plan, legal = _synthetic(budget)
    assert {p.row_pieces for p in legal} == {1, 2, 4, 8}
    request = planner.GraphPlanRequest(ROWS, KV + OUT, _priced(1)[0], 10**12, costs=Costs(0.1, "meta", WORK, H200))
    ratios = [request.time_ratio(p) for p in legal]
    assert all(p.predicted_peak <= budget for p in legal)
    assert plan.predicted_time_ratio == pytest.approx(min(ratios), rel=1e-12)
    whole = min(r for r, p in zip(ratios, legal) if p.row_pieces == 1)
    assert plan.row_pieces > 1 and plan.predicted_time_ratio < whole, (plan.describe(), whole)
    assert plan.predicted_peak == KV + OUT + plan.chunk * PER_ROW[plan.row_pieces]


def test_forced_pieces_or_no_runs_search_no_pieces():
    budget = KV + OUT + 100 * 2**20
    costs = Costs(0.1, "meta", work=WORK, rates=H200)
    forced = plan_graph(ROWS, KV + OUT, _priced(2)[0], 10**12, budget=budget, min_chunk=2048, kv=KV, costs=costs,
                        row_pieces=2)   # the user's count (``graph_call`` passes no others to try)
    assert forced.row_pieces == 2 and forced.predicted_peak == KV + OUT + forced.chunk * PER_ROW[2]
    plan = plan_graph(ROWS, KV + OUT, _priced(1)[0], 10**12, budget=budget, min_chunk=2048, kv=KV,
                      costs=Costs(0.1, "meta", work=WORK, rates=H200))   # no ``priced``: no runs to cut
    assert plan.row_pieces == 1


def test_pieces_cost_their_launches_and_copies():
    base = Streamed(chunk=4096)
    k = -(-ROWS // 4096)
    for p in (2, 4, 8):
        extra = streamed_seconds(WORK, H200, replace(base, pieces=p)) - streamed_seconds(WORK, H200, base)
        assert extra == pytest.approx(pieces_seconds(WORK, H200, p, k), rel=1e-9)
        assert extra == pytest.approx(k * ((p - 1) * 60 + p * 8) * H200.op_s + 16_384.0 * ROWS / H200.bandwidth,
                                      rel=1e-9)
    assert pieces_seconds(WORK, H200, 1, k) == 0.0


# -- the CPU ladder: a real diffusers block, exact, within its budget ----------------------------------------------

def _ltx2_cpu(rows: int):
    """The catalogue's tiny LTX-2 block with a wider MLP (diffusers' FeedForward, 1,024 features)."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention import FeedForward
    from streamplan.tools.catalogue.diffusers_cases import CASES
    torch.manual_seed(0)
    block = CASES["ltx2"].build()
    block.ff = FeedForward(64, mult=16, activation_fn="gelu-approximate").eval()
    args, kwargs = CASES["ltx2"].inputs(rows, torch.device("cpu"), torch.float32)
    return block, args, kwargs


def test_cpu_ladder_tries_no_pieces_that_lower_nothing_and_holds_its_smallest_budget_exactly():
    """Once its audio attention over the video rows was reduced over the chunks, this block's worst moment is no
    longer inside a row-local run: pieces (which turn the in-place rewrites off) would raise it at every slice. The
    planner tries no piece count, and the smallest budget it names runs exactly within itself in whole chunks."""
    rows = 4096
    block, args, kwargs = _ltx2_cpu(rows)
    seen = {}
    chosen = planner._chosen

    def recording(request):
        seen["request"] = request
        return chosen(request)

    mp = pytest.MonkeyPatch()
    mp.setattr(planner, "_chosen", recording)
    try:
        _planned(block, args, kwargs, budget=None, chunk_tokens=256)   # the request's models, planned by none
    finally:
        mp.undo()
    request = seen["request"]
    assert request.pieces == planner.ROW_PIECES
    c = planner.MIN_CHUNK_TOKENS
    for pieces in request.pieces:   # each count's least transient is above the whole chunks' at that slice
        pieced = request.with_pieces(pieces)
        assert all(pieced.transient(c, sl) >= request.transient(c, sl) for sl in (0, 256))
    assert [v.row_pieces for v in request.variants()] == [1]

    live = _nbytes((args, kwargs))
    with pytest.raises(streamplan.BudgetError) as refused:
        _planned(block, args, kwargs, budget=live + 1)
    budget = live + refused.value.smallest_bytes
    plan, report, _ = _planned(block, args, kwargs, budget=budget)
    assert plan.row_pieces == 1, report
    with torch.inference_mode():
        ref = block(*args, **kwargs)
    handle = streamplan.apply(block, capture="prefer", budget=budget)
    try:
        with torch.inference_mode():
            out, peak = streamplan.measure_peak(block, *args, **kwargs)
    finally:
        handle.remove()
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert peak <= budget - live, (peak, budget - live)


# -- a mixture of experts in pieces: its routed copies cost a piece's rows ------------------------------------------

@torch.no_grad()
def test_an_experts_layer_runs_in_row_pieces_exactly_at_a_pieces_workspace():
    pytest.importorskip("transformers")
    from streamplan.tools.catalogue.transformers_cases import CASES
    case = CASES["qwen3_moe"]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(4096, torch.device("cpu"), torch.float32)
    ref = layer(*args, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    peaks, plans = {}, {}
    for pieces in (1, 4):
        handle = streamplan.apply(layer, budget=None, chunk_tokens=1024, row_pieces=pieces)
        try:
            out, peaks[pieces] = streamplan.measure_peak(lambda: layer(*args, **kwargs))
            plans[pieces] = next(iter(handle.installed[""].plans.values()))
        finally:
            handle.remove()
        out = out[0] if isinstance(out, tuple) else out
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    assert plans[4].row_pieces == 4
    assert plans[4].predicted_peak < plans[1].predicted_peak   # the experts' routed copies of a piece's rows
    assert peaks[4] < peaks[1], peaks
    assert peaks[4] <= plans[4].predicted_peak * (1 + PLAN_MARGIN), (peaks, plans[4].predicted_peak)
