"""A whole diffusers ``HunyuanVideo15Transformer3DModel`` (image-to-video, the text masks padded as its pipeline
passes them), stock against streamed: its blocks stream from their captured graph with the text mask it pads over the
image rows inside each block, exact against the model's own forward (fp32, CPU), the call's peak well below stock's,
and the model stock again after ``remove``."""
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import HunyuanVideo15Transformer3DModel  # noqa: E402

import streamplan  # noqa: E402
from conftest import rel_err  # noqa: E402


def _model() -> HunyuanVideo15Transformer3DModel:
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 6, 6),
        target_size=64).eval()


def _inputs(frames: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[:, 9:] = 0   # the last 3 text tokens padding
    mask2 = torch.ones(1, 5, dtype=torch.long)
    mask2[:, 4:] = 0
    return dict(hidden_states=torch.randn(1, 9, frames, 16, 16, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 12, 16, generator=g), encoder_attention_mask=mask,
                encoder_hidden_states_2=torch.randn(1, 5, 8, generator=g), encoder_attention_mask_2=mask2,
                image_embeds=torch.randn(1, 4, 12, generator=g))


@torch.no_grad()
def test_hunyuan_video_15_model_streams_exactly_below_stock_and_restores():
    model, kw = _model(), _inputs()
    ref, stock = streamplan.measure_peak(lambda: model(**kw).sample)
    handle = streamplan.apply(model, chunk_tokens=128)
    out, peak = streamplan.measure_peak(lambda: model(**kw).sample)
    report = handle.report()
    for i in range(2):   # every block from its captured graph, its padded text mask built per chunk
        plan = handle.plans[f"transformer_blocks.{i}"][0]
        assert plan.tier == "L1" and plan.chunk == 128, report
    assert "captured diffusers.HunyuanVideo15TransformerBlock" in report, report
    assert rel_err(out, ref) <= 1e-5, report
    assert peak < 0.5 * stock, (peak, stock, report)
    handle.remove()
    assert torch.equal(model(**kw).sample, ref)


@torch.no_grad()
def test_hunyuan_video_15_model_under_a_budget_plans_each_block_within_it_exactly():
    model, kw = _model(), _inputs(frames=5)
    stock_block = streamplan.measure_peak(lambda: model(**kw).sample)[1]
    handle = streamplan.apply(model, budget=stock_block // 2)
    out, peak = streamplan.measure_peak(lambda: model(**kw).sample)
    assert peak < stock_block, (peak, stock_block, handle.report())
    ref_model = _model()
    assert rel_err(out, ref_model(**kw).sample) <= 1e-5, handle.report()
    for i in range(2):
        plan = handle.plans[f"transformer_blocks.{i}"][0]
        assert plan.predicted_peak <= stock_block // 2, handle.report()
    handle.remove()
