"""ComfyUI 0.33.0's Flux, HunyuanVideo, LTX-Video and Chroma at real width for ``gpu_comfy.py --model
flux|hunyuan_video|ltxv|chroma``: one double and one single stream block (Flux.1-dev / HunyuanVideo / Chroma widths:
hidden 3072, 24 heads x 128, MLP 4x; Chroma's distilled guidance layer as shipped, 5 layers of 5120) or one
LTX-Video block (LTX-Video 2B: 32 heads x 64 = 2048, cross-attention to 4096-wide T5 text), random weights (norms near
1), built as ``comfy.model_base`` builds them, conditioning from ``BaseModel.extra_conds`` as ComfyUI samples them.

``tokens`` counts the rows a block sees: text + image rows for Flux and HunyuanVideo (their double and single blocks
attend over both), video rows for LTX-Video (its text is cross-attention keys). The floor is residual + K + V of
those rows, bf16; ``rope_KB_per_token`` is the rope table every block reads (measured on the first block's inputs),
which the model forward builds whole, stock and streamed alike."""
from __future__ import annotations

import importlib
import math

import torch

from common import random_weights

FLUX = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0,
            num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
            qkv_bias=True, guidance_embed=True, txt_ids_dims=[])
FLUX_SMOKE = dict(FLUX, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0, num_heads=4,
                  axes_dim=[4, 6, 6], in_channels=4, out_channels=4)
HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072,
                     mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=256,
                     patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
                     use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
HUNYUAN_VIDEO_SMOKE = dict(HUNYUAN_VIDEO, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
                           num_heads=4, axes_dim=[4, 6, 6], in_channels=4, out_channels=4)
CHROMA = dict(in_channels=64, out_channels=64, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
              depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
              in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5, txt_ids_dims=[], vec_in_dim=None)
CHROMA_SMOKE = dict(CHROMA, in_channels=16, out_channels=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
                    num_heads=4, axes_dim=[4, 6, 6], out_dim=64, hidden_dim=32, n_layers=2)
LTXV = dict(in_channels=128, cross_attention_dim=2048, attention_head_dim=64, num_attention_heads=32,
            caption_channels=4096, num_layers=1)
LTXV_SMOKE = dict(LTXV, in_channels=8, cross_attention_dim=64, attention_head_dim=16, num_attention_heads=4,
                  caption_channels=32)

# name -> (image_model, comfy.model_base class, latent format, real dims, smoke dims)
MODELS = {"flux": ("flux", "Flux", "Flux", FLUX, FLUX_SMOKE),
          "hunyuan_video": ("hunyuan_video", "HunyuanVideo", "HunyuanVideo", HUNYUAN_VIDEO, HUNYUAN_VIDEO_SMOKE),
          "ltxv": ("ltxv", "LTXV", "LTXV", LTXV, LTXV_SMOKE),
          "chroma": ("chroma", "Chroma", "Flux", CHROMA, CHROMA_SMOKE)}


def width(dims: dict) -> int:
    return dims["hidden_size"] if "hidden_size" in dims else dims["attention_head_dim"] * dims["num_attention_heads"]


def build(comfy, name: str, dev, dtype, smoke: bool, n: int, text: int, latent_grid, model_dev=None):
    """(BaseModel, x, cond() -> the call's conditioning, the latent grid, rows a block sees, hidden width, a line
    naming the model, extra facts for the results)."""
    importlib.import_module({"flux": "comfy.ldm.flux.model", "hunyuan_video": "comfy.ldm.hunyuan_video.model",
                             "ltxv": "comfy.ldm.lightricks.model", "chroma": "comfy.ldm.chroma.model"}[name])
    image_model, base_cls, latent, dims, smoke_dims = MODELS[name]
    dims = smoke_dims if smoke else dims
    unet = {"image_model": image_model, "dtype": dtype, **dims}

    class Config(comfy.supported_models_base.BASE):
        unet_config, unet_extra_config, sampling_settings = {}, {}, {"shift": 1.0}
        supported_inference_dtypes = [dtype]
        latent_format = getattr(comfy.latent_formats, latent)
    base = getattr(comfy.model_base, base_cls)(Config(unet), device=model_dev or dev)
    random_weights(base, ("weight", "scale"))
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = width(dims)
    text_dim = dims.get("context_in_dim", dims.get("caption_channels"))
    context = torch.randn(1, text, text_dim, device=dev, dtype=dtype, generator=g)
    if name in ("flux", "chroma"):
        side = max(1, round(math.sqrt(max(1, n - text))))
        grid = (1, side, side)
        channels = dims["in_channels"] // (4 if name == "chroma" else 1)   # Chroma counts the 2x2-patched channels
        x = torch.randn(1, channels, 2 * side, 2 * side, device=dev, generator=g)
        rows = text + side * side
        kwargs = dict(cross_attn=context, guidance=3.5 if name == "flux" else 0.0)
        if name == "flux":
            kwargs["pooled_output"] = torch.randn(1, dims["vec_in_dim"], device=dev, dtype=dtype, generator=g)
        line = (f"comfy {'Flux' if name == 'flux' else 'Chroma'} 1 double + 1 single block (hidden {hidden}, "
                f"{dims['num_heads']} heads)")
    elif name == "hunyuan_video":
        grid = latent_grid(max(1, n - text))
        f, h, w = grid
        x = torch.randn(1, dims["in_channels"], f, 2 * h, 2 * w, device=dev, generator=g)
        rows = text + f * h * w
        mask = torch.ones(1, text, dtype=torch.long, device=dev)
        mask[:, text - text // 4:] = 0           # padded text, as ComfyUI's text encoder hands it over
        kwargs = dict(cross_attn=context, attention_mask=mask, guidance=6.0,
                      pooled_output=torch.randn(1, dims["vec_in_dim"], device=dev, dtype=dtype, generator=g))
        line = (f"comfy HunyuanVideo 1 double + 1 single block (hidden {hidden}, {dims['num_heads']} heads), text mask "
                f"over its last {text // 4} rows")
    else:
        grid = latent_grid(n)                    # LTX-Video's latent takes 1x1x1 patches: one row per latent pixel
        f, h, w = grid
        x = torch.randn(1, dims["in_channels"], f, h, w, device=dev, generator=g)
        rows = f * h * w
        mask = torch.ones(1, text, device=dev)
        mask[:, text - text // 4:] = 0
        kwargs = dict(cross_attn=context, attention_mask=mask, frame_rate=25)
        line = (f"comfy LTXVModel 1 block (inner {hidden}, {dims['num_attention_heads']} heads x "
                f"{dims['attention_head_dim']}), T5 text mask over its last {text // 4} rows")
    cond = lambda: {k: v.cond for k, v in base.extra_conds(device=dev, **kwargs).items()}  # noqa: E731
    return base, x, cond, grid, rows, hidden, line, {"text_rows": text, "block_rows": rows}


def rope_bytes(patcher, x, cond, sample_call) -> int:
    """Bytes of the rope table the first block is handed (measured with a pre-hook on a stock call)."""
    from streamplan.integrations.comfy import block_keys
    seen = {}

    def hook(_module, args, kwargs):
        pe = kwargs.get("pe")
        tables = [t for t in (pe if isinstance(pe, tuple) else (pe,)) if isinstance(t, torch.Tensor)]
        seen["bytes"] = sum(t.numel() * t.element_size() for t in tables)
    first = block_keys(patcher.model.diffusion_model)[0][2]
    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        sample_call(patcher, x, cond)
    finally:
        handle.remove()
    return seen.get("bytes", 0)
