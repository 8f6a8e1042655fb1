"""MiniMax-H3 end to end (diffusers ``MiniMaxH3Transformer3DModel``): packed sequence built in place, blocks from
their captured graph with donated inputs, both heads streamed; against the real model's own forward."""
import pytest
import torch

import streamplan
from conftest import rel_err

HIDDEN, HEADS, HEAD_DIM = 64, 4, 16
TEXT, COND, AUDIO, TARGET = 24, 40, 30, 160     # packed rows: text, conditioning video, audio, target video


def _model(layers=2):
    from diffusers import MiniMaxH3Transformer3DModel
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=HIDDEN, num_layers=layers,
        num_refiner_layers=1, ffn_dim=128, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=48,
        freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=2).eval()


def _inputs(batch=1, target=TARGET):
    n = TEXT + COND + AUDIO + target
    text = torch.arange(0, TEXT)
    cond = torch.arange(TEXT, TEXT + COND)
    audio = torch.arange(TEXT + COND, TEXT + COND + AUDIO)
    target_rows = torch.arange(TEXT + COND + AUDIO, n)
    video = torch.cat([cond, target_rows])
    tags = torch.zeros(n, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    ts_idx = torch.zeros(n, dtype=torch.long)            # two noise levels: conditioning rows clean, the rest noisy
    ts_idx[audio], ts_idx[target_rows] = 1, 1
    pos = torch.randint(0, 8, (n, 3))
    return dict(hidden_states=torch.randn(batch, COND + target, 16), audio_hidden_states=torch.randn(batch, AUDIO, 8),
                encoder_hidden_states=torch.randn(batch, TEXT, 48), timestep=torch.tensor([0.0, 0.7]),
                timestep_indices=ts_idx, token_tags=tags, position_ids=pos, video_indices=video, audio_indices=audio,
                text_indices=text)


@torch.no_grad()
@pytest.mark.parametrize("mode", [dict(chunk_tokens=48), dict(chunk_tokens=100)])
def test_h3_model_streams_both_outputs_exactly_and_restores(mode):
    model, kw = _model(), _inputs()
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    handle = streamplan.apply(model, **mode)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    report = handle.report()
    assert rel_err(out.sample, ref.sample) <= 1e-5 and rel_err(out.audio_sample, ref.audio_sample) <= 1e-5, report
    assert "packed in place" in report
    for i in range(2):   # every block of the stack streamed from its captured graph
        (plan,) = handle.plans[f"transformer_blocks.{i}"]
        assert plan.tier == "L1" and plan.rows == TEXT + COND + AUDIO + TARGET, report
    assert peak < stock_peak, (peak, stock_peak)
    handle.remove()
    again = model(**kw)
    assert torch.equal(again.sample, ref.sample) and torch.equal(again.audio_sample, ref.audio_sample)
    assert not any("forward" in m.__dict__ for m in model.modules())


@torch.no_grad()
def test_h3_model_peak_is_near_the_floor_at_longer_sequences():
    model = _model(layers=1)
    kw = _inputs(target=1400)
    n = kw["position_ids"].shape[0]
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    handle = streamplan.apply(model, chunk_tokens=128)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    assert rel_err(out.sample, ref.sample) <= 1e-5 and rel_err(out.audio_sample, ref.audio_sample) <= 1e-5
    floor = n * HIDDEN * 4 * 3                      # the residual, K and V over every packed row, fp32
    outputs = out.sample.numel() * 4 + out.audio_sample.numel() * 4
    # residual + K + V, both outputs, and one 128-row chunk of a 64-wide block's transients (large against a
    # 64-wide residual: at real widths the chunk is a few percent)
    assert peak <= 1.5 * floor + outputs, (peak / floor, stock_peak / floor)
    assert stock_peak > 2 * peak
    handle.remove()


def test_h3_model_forward_of_another_version_stays_stock(monkeypatch):
    from streamplan.integrations.diffusers import models as diffusers_models
    monkeypatch.setitem(diffusers_models.KNOWN_FORWARDS, "MiniMaxH3Transformer3DModel", {"0000": "other"})
    model, kw = _model(layers=1), _inputs()
    with torch.no_grad():
        ref = model(**kw)
        handle = streamplan.apply(model, chunk_tokens=48)
        out = model(**kw)
    assert "model forward left stock" in handle.report() and "differs from the versions" in handle.report()
    assert rel_err(out.sample, ref.sample) <= 1e-5
    assert any(p.tier == "L1" for p in handle.plans["transformer_blocks.0"])   # its blocks still stream
    handle.remove()


@torch.no_grad()
def test_h3_model_under_a_budget_plans_chunks_that_keep_to_it():
    model = _model(layers=2)
    kw = _inputs(target=1400)
    ref, stock_peak = streamplan.measure_peak(lambda: model(**kw))
    inputs = sum(t.numel() * t.element_size() for t in kw.values())
    budget = inputs + int(0.6 * stock_peak)
    handle = streamplan.apply(model, budget=budget)
    out, peak = streamplan.measure_peak(lambda: model(**kw))
    assert rel_err(out.sample, ref.sample) <= 1e-5 and rel_err(out.audio_sample, ref.audio_sample) <= 1e-5
    (plan,) = handle.plans["transformer_blocks.0"]
    assert plan.tier == "L1" and plan.chunk < plan.rows, handle.report()
    # on CPU a plan sees what each call receives; tensors the model forward holds between calls (its own inputs,
    # rotary tables) are seen only on CUDA, through the allocator: a few percent here
    assert peak + inputs <= 1.05 * budget, (peak, budget)
    assert peak < 0.75 * stock_peak
    handle.remove()
