"""HunyuanVideo 1.5 in ComfyUI 0.33.0 (``comfy.model_base.HunyuanVideo15``: the HunyuanVideo model with 1.5's
ByT5 glyph text, SigLIP vision tokens and a condition-type embedding put in front of the text, image and mask
channels concatenated to the noise, no pooled vector), stock against ``streamplan.integrations.comfy.patch``: its
streamed model forward and its double blocks, under the two conditionings its pipeline gives (glyph text and a
reference image's vision tokens; a padded prompt mask, the key mask ComfyUI builds over text and image rows)."""
from __future__ import annotations

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import _block_lines, _config, _random_, fresh_captures, sample_call  # noqa: F401

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_captures")


class _VisionOutput:
    """What ComfyUI's CLIPVisionEncode hands the model (only ``last_hidden_state`` is read)."""

    def __init__(self, tokens: int, width: int):
        self.last_hidden_state = torch.randn(1, tokens, width)


def hunyuan15_patcher(conditioning: str):
    comfy = comfyui()
    unet = {"image_model": "hunyuan_video", "in_channels": 9, "out_channels": 4, "vec_in_dim": None,
            "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 2,
            "depth_single_blocks": 0, "axes_dim": [4, 6, 6], "theta": 256, "patch_size": [1, 1, 1],
            "qkv_bias": True, "guidance_embed": False, "byt5": True, "meanflow": False,
            "use_cond_type_embedding": True, "vision_in_dim": 24, "meanflow_sum": True}
    base = comfy.model_base.HunyuanVideo15(_config(comfy, unet, comfy.latent_formats.HunyuanVideo15))
    _random_(base)
    x = torch.randn(1, 4, 3, 8, 8)              # 3 x 8 x 8 = 192 image rows
    if conditioning == "glyph_and_vision":      # 4 ByT5 + 5 vision + 9 prompt tokens in front of the image rows
        extra = {"conditioning_byt5small": torch.randn(1, 4, 1472), "clip_vision_output": _VisionOutput(5, 24)}
    else:                                       # the prompt padded to 9 tokens, 3 of them padding
        mask = torch.ones(1, 9, dtype=torch.long)
        mask[:, 6:] = 0
        extra = {"attention_mask": mask}
    cond = {k: v.cond for k, v in base.extra_conds(device=CPU, noise=x, cross_attn=torch.randn(1, 9, 32),
                                                    pooled_output=None, **extra).items()}
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


@pytest.mark.parametrize("conditioning", ["glyph_and_vision", "padded_prompt"])
def test_hunyuan_video_15_streams_exact(conditioning):
    """The model forward streamed (input projection and head in row chunks, block inputs donated) and both double
    blocks streamed from their graphs with the text rows joined as static rows: bit-identical to ComfyUI's own
    forward, the peak down."""
    import streamplan.integrations.comfy as sc
    base, x, cond = hunyuan15_patcher(conditioning)
    stock, stock_peak = streamplan.measure_peak(sample_call, base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(out, stock) == 0.0
    assert peak < 0.8 * stock_peak, (peak, stock_peak)
    text = sc.report(patched)
    assert "model forward (HunyuanVideo): 1 call(s) streamed" in text, text
    sections = _block_lines(text)
    text_rows = 18 if conditioning == "glyph_and_vision" else 9
    for i in range(2):
        section = sections[f"double_block.{i}"]
        assert "L1 rows=192 chunk=64" in section and "ran stock" not in section, text
        assert f"{text_rows} static rows joined" in section, text
    if conditioning == "padded_prompt":
        assert "attn_mask=(1, 1, 1, 201)" in text, text
