"""LTX-2 end to end (diffusers ``LTX2VideoTransformer3DModel``): per-token timesteps as its image-to-video pipeline
hands them (the conditioning frame's rows at 0), the per-row tables and rotary tables built a chunk's rows at a time,
blocks from their captured graph with donated inputs; against the real model's own forward."""
import pytest
import torch

import streamplan
from conftest import rel_err

WIDTH, AUDIO_WIDTH, TEXT, AUDIO = 32, 16, 7, 12


def _model(layers=2, **extra):
    from diffusers import LTX2VideoTransformer3DModel
    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=WIDTH,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=AUDIO_WIDTH, num_layers=layers, caption_channels=24, **extra).eval()


def _inputs(frames=3, height=8, width=10, per_token=True):
    """Row counts kept off the model's widths (32, 96, 128, 192, ...): a capture reads a size equal to the row count
    as rows."""
    n = frames * height * width
    g = torch.Generator().manual_seed(1)
    if per_token:   # the image-to-video pipeline: t * (1 - conditioning mask), the first frame clean
        timestep = torch.full((1, n), 700.0)
        timestep[:, :height * width] = 0.0
    else:
        timestep = torch.tensor([700.0])
    return dict(hidden_states=torch.randn(1, n, 8, generator=g),
                audio_hidden_states=torch.randn(1, AUDIO, 8, generator=g),
                encoder_hidden_states=torch.randn(1, TEXT, 24, generator=g),
                audio_encoder_hidden_states=torch.randn(1, TEXT, 24, generator=g), timestep=timestep,
                audio_timestep=torch.tensor([700.0]), sigma=torch.tensor([0.7]), num_frames=frames, height=height,
                width=width, audio_num_frames=AUDIO)


def _close(out, ref) -> bool:
    return rel_err(out.sample, ref.sample) <= 1e-5 and rel_err(out.audio_sample, ref.audio_sample) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("per_token", [True, False])
def test_ltx2_model_streams_both_outputs_exactly_and_restores(per_token):
    model, kw = _model(), _inputs(per_token=per_token)
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    handle = streamplan.apply(model, chunk_tokens=48)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    report = handle.report()
    assert _close(out, ref), report
    assert "per-row tables described" in report and "built whole" not in report, report
    for i in range(2):   # every block streamed from its captured graph
        (plan,) = handle.plans[f"transformer_blocks.{i}"]
        assert plan.tier == "L1" and plan.rows == kw["hidden_states"].shape[1], report
    assert peak < stock_peak, (peak, stock_peak)
    handle.remove()
    again = model(**kw)
    assert torch.equal(again.sample, ref.sample) and torch.equal(again.audio_sample, ref.audio_sample)
    assert not any("forward" in m.__dict__ for m in model.modules())


@torch.no_grad()
def test_ltx2_per_token_tables_are_never_whole():
    # stock holds the per-row modulation, cross-attention modulation and rotary tables for every row (17 of the
    # 32-wide residual's widths here); streamed, they cost a chunk's rows: the peak grows with the rows as it does
    # under one timestep for every row
    model = _model(layers=1)
    handle = streamplan.apply(model, chunk_tokens=160)
    growth = {}
    for per_token in (True, False):
        peaks = []
        for frames in (5, 10):
            kw = _inputs(frames=frames, height=16, width=18, per_token=per_token)
            _, peak = streamplan.measure_peak(lambda: model(**kw))
            peaks.append(peak)
        growth[per_token] = peaks[1] - peaks[0]
    assert growth[True] <= 1.05 * growth[False], growth
    handle.remove()
    kw = _inputs(frames=10, height=16, width=18)
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    handle = streamplan.apply(model, chunk_tokens=160)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    assert _close(out, ref)
    floor = kw["hidden_states"].shape[1] * WIDTH * 4 * 3   # the residual, K and V over the video rows, fp32
    assert stock_peak > 3 * peak, (stock_peak / floor, peak / floor)
    handle.remove()


@torch.no_grad()
def test_ltx2_a_block_left_stock_gets_its_tables_whole():
    model, kw = _model(), _inputs()
    ref = model(**kw)
    model.transformer_blocks[1].register_forward_hook(lambda m, a, o: None)
    handle = streamplan.apply(model, chunk_tokens=48)
    out = model(**kw)
    assert _close(out, ref), handle.report()
    assert any(p.tier == "L1" for p in handle.plans["transformer_blocks.0"])
    assert "transformer_blocks.1" not in handle.plans or not handle.plans["transformer_blocks.1"], handle.report()
    handle.remove()


def test_ltx2_model_forward_of_another_version_stays_stock(monkeypatch):
    from streamplan.integrations.diffusers import models as diffusers_models
    monkeypatch.setitem(diffusers_models.KNOWN_FORWARDS, "LTX2VideoTransformer3DModel", {"0000": "other"})
    model, kw = _model(layers=1), _inputs()
    with torch.no_grad():
        ref = model(**kw)
        handle = streamplan.apply(model, chunk_tokens=48)
        out = model(**kw)
    assert "model forward left stock" in handle.report() and "differs from the versions" in handle.report()
    assert _close(out, ref)
    assert any(p.tier == "L1" for p in handle.plans["transformer_blocks.0"])   # its blocks still stream
    handle.remove()


@torch.no_grad()
def test_ltx2_model_budget_is_held_for_the_whole_forward_or_refused_before_it_runs():
    model, kw = _model(layers=2), _inputs(frames=5, height=16, width=18)
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    budget = int(0.3 * stock_peak)
    handle = streamplan.apply(model, budget=budget)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    assert _close(out, ref), handle.report()
    assert "planned ahead" in handle.report() and peak <= budget, (peak, budget, handle.report())
    handle.remove()
    handle = streamplan.apply(model, budget=budget // 20)
    with pytest.raises(streamplan.BudgetError) as err:
        model(**kw)
    smallest = err.value.smallest_bytes
    assert isinstance(smallest, int) and budget // 20 < smallest, str(err.value)
    handle.remove()
    handle = streamplan.apply(model, budget=smallest)   # the smallest it named runs, within itself
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    assert _close(out, ref) and peak <= smallest, (peak, smallest)
    handle.remove()


def _batched(kw: dict, n: int = 2) -> dict:
    """The same call for a batch of ``n`` (the guidance passes a sampler batches), each element's latents its own."""
    g = torch.Generator().manual_seed(2)
    out = {k: (torch.cat([v] * n) if isinstance(v, torch.Tensor) and v.shape[0] == 1 else v) for k, v in kw.items()}
    out["hidden_states"] = torch.randn(out["hidden_states"].shape, generator=g)
    return out


@torch.no_grad()
@pytest.mark.parametrize("mask", [[0.0], [1.0], [0.0, 1.0]], ids=["all-perturbed", "none-perturbed", "mixed"])
def test_ltx2_spatio_temporal_guidance_blocks_stream_exactly(mask):
    """LTX-2.X's perturbed attention (STG) on block 0, as its pipelines' guidance passes call it: the model forward
    hands the block a Python bool for "every element perturbed" where stock hands a 0-d tensor (the processor only
    branches on it), so the perturbed block streams from its graph instead of staying stock on a data-dependent
    branch."""
    model, kw = _model(perturbed_attn=True), _inputs()
    if len(mask) > 1:
        kw = _batched(kw, len(mask))
    kw.update(spatio_temporal_guidance_blocks=[0], perturbation_mask=torch.tensor(mask))
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    handle = streamplan.apply(model, chunk_tokens=48)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    report = handle.report()
    assert _close(out, ref), report
    for i in range(2):
        (plan,) = handle.plans[f"transformer_blocks.{i}"]
        assert plan.tier == "L1", report
    assert peak < stock_peak / 2, (peak, stock_peak, report)
    handle.remove()
