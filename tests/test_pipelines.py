"""``streamplan.apply(pipe)``: every denoiser of a diffusers pipeline streamed from one call. Wan 2.2 A14B's pipeline
runs its high-noise ``transformer`` for the early steps and its low-noise ``transformer_2`` after the boundary; a
tiny real ``WanPipeline`` (random weights, embeddings passed in, latents out) against its own stock run."""
import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

import streamplan
from conftest import rel_err
from test_blocks import _wan_model


def _pipe(two: bool = True) -> WanPipeline:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False,
                           True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=_wan_model(), transformer_2=_wan_model() if two else None,
                       boundary_ratio=0.5 if two else None)


def _run(pipe: WanPipeline) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    text, neg = torch.randn(1, 7, 32, generator=g), torch.randn(1, 7, 32, generator=g)
    return pipe(prompt_embeds=text, negative_prompt_embeds=neg, height=64, width=64, num_frames=9,
                num_inference_steps=4, guidance_scale=3.0, output_type="latent", generator=g).frames


@torch.no_grad()
def test_one_apply_streams_both_transformers_of_a_two_stage_pipeline():
    pipe = _pipe()
    ref = _run(pipe)
    handle = streamplan.apply(pipe, chunk_tokens=128)
    assert isinstance(handle, streamplan.PipelineHandle) and list(handle.handles) == ["transformer", "transformer_2"]
    out = _run(pipe)
    assert rel_err(out, ref) <= 1e-5, handle.report()
    for part in ("transformer", "transformer_2"):   # each planned at its own calls (both stages ran)
        assert handle.plans[part], (part, handle.report())
        assert handle.plans[f"{part}.blocks.0"], (part, handle.report())
    report = handle.report()
    assert "[transformer_2] streamplan report for WanTransformer3DModel" in report, report
    assert '"transformer_2"' in handle.to_json()
    handle.remove()
    assert handle.removed and "forward" not in pipe.transformer_2.__dict__
    assert torch.equal(_run(pipe), ref)


@torch.no_grad()
def test_a_pipeline_budget_holds_each_denoisers_call():
    pipe = _pipe()
    x, t, enc = torch.randn(1, 4, 3, 32, 32), torch.tensor([500]), torch.randn(1, 7, 32)
    stock = streamplan.measure_peak(lambda: pipe.transformer(x, t, enc).sample)[1]
    handle = streamplan.apply(pipe, budget=stock // 2)
    for part in ("transformer", "transformer_2"):
        peak = streamplan.measure_peak(lambda: getattr(pipe, part)(x, t, enc).sample)[1]
        assert peak <= stock // 2, (part, peak, stock, handle[part].report())
    handle.remove()


def test_a_pipeline_without_a_second_stage_and_what_is_not_a_pipeline():
    pipe = _pipe(two=False)
    handle = streamplan.apply(pipe)
    assert list(handle.handles) == ["transformer"]
    handle.remove()
    with pytest.raises(ValueError, match="a torch.nn.Module or a diffusers pipeline, got dict"):
        streamplan.apply({"transformer": pipe.transformer})


def test_a_failed_apply_leaves_every_denoiser_as_it_was(monkeypatch):
    from streamplan import api
    pipe = _pipe()
    calls = []

    def failing(module, options):
        if calls:
            raise RuntimeError("second fails")
        calls.append(module)
        return original(module, options)

    original = api._apply_module
    monkeypatch.setattr(api, "_apply_module", failing)
    with pytest.raises(RuntimeError, match="second fails"):
        streamplan.apply(pipe)
    assert "forward" not in pipe.transformer.__dict__ and "forward" not in pipe.transformer_2.__dict__
