"""Chunk replay (``execute.chunk_replay``): a captured block's chunks of one size, after the first two, replayed as one
recording. On the CPU the recording is re-run through the same staging (``RerunRecorder``), so what is checked here
is the staging: every chunk's rows copied in, its outputs copied out, exact against the real modules' own forwards;
the memory the staging takes priced by the plan and held under a budget; what cannot replay refused and said; a
recording that fails leaving the call's chunks eager. The CUDA graph itself runs in ``benchmarks/gpu_time_model.py``."""
import dataclasses

import pytest
import torch

import streamplan
from conftest import rel_err, streamed
from streamplan.execute import chunk_replay
from streamplan.plan import time_model
from streamplan.tools.families import FAMILIES, on_meta

ROWS, CHUNK = 1024, 64


@pytest.fixture
def replays(monkeypatch):
    """How many chunks the CPU recorder replayed."""
    seen = {"replays": 0}
    replay = chunk_replay.RerunRecorder.replay

    def counted(self, i):
        seen["replays"] += i == 0   # each replayed chunk replays its first run once
        return replay(self, i)
    monkeypatch.setattr(chunk_replay.RerunRecorder, "replay", counted)
    return seen


def _wan(rows: int = ROWS):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    block = WanTransformerBlock(64, 128, 2, cross_attn_norm=True).eval()
    pos = torch.randn(1, rows, 1, 32)
    return block, (torch.randn(1, rows, 64), torch.randn(1, 16, 64), torch.randn(1, 6, 64), (pos.cos(), pos.sin()))


def _flux_double():
    """Text rows joined to the image rows inside the block (static rows: later chunks run the image rows alone)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    block = FluxTransformerBlock(64, 2, 32).eval()
    pos = torch.randn(32 + ROWS, 32)
    return block, (torch.randn(1, ROWS, 64), torch.randn(1, 32, 64), torch.randn(1, 64), (pos.cos(), pos.sin()))


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _root_plan(handle):
    return next(iter(handle.installed[""].plans.values()))


@pytest.mark.parametrize("make", [_wan, _flux_double], ids=["wan", "flux-double-static-rows"])
def test_replayed_chunks_are_the_eager_chunks_and_stock(make, replays):
    block, args = make()
    with torch.no_grad():
        ref = _outputs(block(*args))
        with streamed(block, budget=None, chunk_tokens=CHUNK, replay=False) as handle:
            eager = _outputs(block(*args))
            assert not _root_plan(handle).replay
        assert replays["replays"] == 0
        with streamed(block, budget=None, chunk_tokens=CHUNK, replay=True) as handle:
            out = _outputs(block(*args))
            plan = _root_plan(handle)
            assert plan.replay and "replayed" in handle.report(), handle.report()
    chunks = ROWS // CHUNK
    # phase KV and phase Q each: the first chunk eager, the second recorded, the rest replayed
    assert replays["replays"] == 2 * (chunks - 2)
    for o, e, r in zip(out, eager, ref):
        assert torch.equal(o, e)
        assert rel_err(o, r) <= 1e-5


def test_replay_under_a_budget_prices_its_staging_and_holds(replays):
    block, args = _wan(4096)   # chunks of the planner's 256-row floor and up: enough of them to replay
    with torch.no_grad():
        ref = block(*args)
        _, stock = streamplan.measure_peak(block, *args)
        live = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(args))
        budget = live + int(0.7 * stock)
        plans = {}
        for replay in (False, True):
            with streamed(block, budget=budget, replay=replay) as handle:
                out, peak = streamplan.measure_peak(block, *args)
                plans[replay] = _root_plan(handle)
                assert rel_err(out, ref) <= 1e-5
                assert live + peak <= budget, handle.report()
                assert peak <= plans[replay].predicted_peak, handle.report()
    assert plans[True].replay and not plans[False].replay
    assert replays["replays"] > 0
    # the staging (each chunk's rows in and out) is priced: under the same budget a replayed chunk is no larger
    assert plans[True].chunk <= plans[False].chunk


def test_a_causal_layer_replays_its_runs_around_the_attention(replays):
    """A causal attention's keys depend on where a chunk starts: it runs eager between the recorded runs, for the
    chunk it is, against transformers' own model."""
    from transformers import LlamaConfig, LlamaModel
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=128, attn_implementation="sdpa")
    model = LlamaModel(cfg).eval()
    ids = torch.randint(0, 128, (1, 512))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).last_hidden_state
        with streamed(model, budget=None, chunk_tokens=CHUNK, replay=True, capture="prefer") as handle:
            out = model(input_ids=ids, use_cache=False).last_hidden_state
            plans = [p for n, e in handle.installed.items() if n.startswith("layers.") for p in e.plans.values()]
    assert len(plans) == 2 and all(p.replay for p in plans), plans
    assert replays["replays"] == 2 * 2 * (512 // CHUNK - 2)   # two layers, phase KV and Q
    assert rel_err(out, ref) <= 1e-5


def test_a_block_that_cannot_replay_runs_eager_and_the_report_says_why(replays):
    from streamplan.tools.catalogue.transformers_cases import CASES
    case = CASES["lfm2_conv"]   # a short convolution along the rows: each chunk reads its neighbours' rows
    layer = case.build()
    args, kwargs = case.inputs(1000, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ref = layer(*args, **kwargs)
        with streamed(layer, budget=None, chunk_tokens=CHUNK, replay=True) as handle:
            out = layer(*args, **kwargs)
            report = handle.report()
    assert "chunk replay (replay=True) not for this block: convolutions along the rows" in report, report
    assert replays["replays"] == 0
    o, r = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)
    assert rel_err(o, r) <= 1e-5


def test_what_the_user_forced_is_kept_and_the_report_says_replay_was_not_used(replays):
    """Head groups the user set (L3) are not replayed, nor a plan of too few chunks: the plan is the user's, and the
    report says why replay did not run."""
    block, args = _wan()
    with torch.no_grad():
        ref = block(*args)
        for kw in ({"chunk_tokens": CHUNK, "head_groups": 2}, {"chunk_tokens": ROWS // 2}):
            with streamed(block, budget=None, replay=True, **kw) as handle:
                out = block(*args)
                plan, report = _root_plan(handle), handle.report()
            assert not plan.replay and plan.chunk == kw["chunk_tokens"], plan.describe()
            assert plan.head_groups == kw.get("head_groups", 1)
            assert "chunk replay (replay=True) not used by this plan" in report, report
            assert rel_err(out, ref) <= 1e-5
    assert replays["replays"] == 0


class _FailingRecorder(chunk_replay.RerunRecorder):
    """A recording that fails as a CUDA capture does on an op it cannot record."""

    def record(self, i, fn, env):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_recording_that_fails_leaves_the_chunks_eager_and_is_reported(monkeypatch, replays):
    monkeypatch.setattr(chunk_replay, "recorder_for", lambda device, fake: _FailingRecorder)
    block, args = _wan()
    with torch.no_grad():
        ref = block(*args)
        with streamed(block, budget=None, chunk_tokens=CHUNK, replay=True) as handle:
            out = block(*args)
            report = handle.report()
    assert "chunk replay off for a call: its recording failed (RuntimeError: operation not permitted" in report, \
        report
    assert replays["replays"] == 0
    assert rel_err(out, ref) <= 1e-5


def test_replay_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="replay must be True, False or None"):
        streamplan.StreamOptions(replay="yes")


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor))


def _meta_wan_plans(replays=(None, False), hold: float = 1.15) -> tuple[dict, int]:
    """Wan2.1-14B at 32,768 rows under its inputs + ``hold`` x the floor, planned on meta as the benchmark GPU."""
    fam = FAMILIES["wan-14b-block"]
    module, inputs = on_meta(fam, 32768, torch.bfloat16)
    budget = int(_nbytes(inputs) + hold * fam.floor_bytes_per_token(torch.bfloat16) * 32768)
    plans = {}
    for replay in replays:
        with streamed(module, capture="prefer", budget=budget, replay=replay) as handle:
            with torch.inference_mode():
                module(*inputs)
            plans[replay] = _root_plan(handle)
    return plans, budget - _nbytes(inputs)


def test_meta_planner_weighs_replay_once_the_device_has_replay_rates(monkeypatch):
    """With replay rates fitted for the device (a hypothetical 0.05 of the host time per op), the time model prices
    short chunks replayed below every plan without replay and the planner takes one; ``replay=False`` never does.
    (At 1.15x the floor the recording stream's workspace leaves replayed chunks of 512 rows, under the host-staged
    plan by the model even with replay free: 1.2x here.)"""
    monkeypatch.setitem(time_model.RATES, "meta", dataclasses.replace(time_model.H200, replay_op=0.05))
    plans, budget = _meta_wan_plans(hold=1.2)
    chosen, eager = plans[None], plans[False]
    assert chosen.replay and not eager.replay, (chosen.describe(), eager.describe())
    assert chosen.predicted_time_ratio < eager.predicted_time_ratio
    assert chosen.predicted_peak <= budget


def test_without_fitted_replay_rates_the_planner_leaves_replay_to_the_user():
    """The shipped rates have no replay terms until a GPU sweep fits them: ``replay=None`` plans as ``False`` does,
    and ``replay=True`` replays, priced as eager chunks."""
    assert time_model.H200.replay_op is None
    plans, budget = _meta_wan_plans((None, False, True))
    assert not plans[None].replay
    assert plans[None].describe(figures=False) == plans[False].describe(figures=False)
    assert plans[True].replay and plans[True].predicted_peak <= budget


def test_a_replayed_plan_prices_the_recording_streams_workspace(monkeypatch):
    """A recording stream's first GEMM gets a cuBLAS workspace of its own (32 MiB on an H100, measured), held from
    then on: where graphs are recorded a replayed plan prices it beside its staging, at the size
    ``CUBLAS_WORKSPACE_CONFIG`` sets where it is set; the CPU's re-run recorder makes none."""
    from streamplan.execute.chunk_replay import DEFAULT_CUBLAS_WORKSPACE, replay_held_bytes
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert replay_held_bytes(torch.device("meta")) == DEFAULT_CUBLAS_WORKSPACE == 32 << 20
    assert replay_held_bytes(torch.device("cpu")) == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert replay_held_bytes(torch.device("meta")) == (4096 * 2 + 16 * 8) << 10
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    fam = FAMILIES["wan-14b-block"]
    module, inputs = on_meta(fam, 32768, torch.bfloat16)
    peaks = {}
    for replay in (False, True):
        with streamed(module, capture="prefer", chunk_tokens=1024, replay=replay) as handle:
            with torch.inference_mode():
                module(*inputs)
            plan = _root_plan(handle)
        assert plan.replay == replay
        peaks[replay] = plan.predicted_peak
    assert peaks[True] - peaks[False] >= DEFAULT_CUBLAS_WORKSPACE, peaks
