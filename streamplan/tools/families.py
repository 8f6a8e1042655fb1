"""Named real-width model families: what `streamplan plan`, `demo` and `bench` build, from the libraries' own
classes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device, torch.dtype], tuple]
    floor_bytes_per_token: Callable[[torch.dtype], float]   # residual + K + V per token
    call_kwargs: dict | None = None                          # keywords of the call beside the inputs


def _wan_block(dim: int, ffn: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock
        return WanTransformerBlock(dim, ffn, heads, cross_attn_norm=True)
    return build


def _wan_inputs(dim: int, heads: int) -> Callable:
    def inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
        freqs = torch.randn(1, n, 1, dim // heads, device=dev)
        return (torch.randn(1, n, dim, device=dev, dtype=dt), torch.randn(1, 512, dim, device=dev, dtype=dt),
                torch.randn(1, 6, dim, device=dev), (freqs.cos(), freqs.sin()))
    return inputs


def _flux(single: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
        return (FluxSingleTransformerBlock if single else FluxTransformerBlock)(3072, 24, 128)
    return build


def _flux_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    freqs = torch.randn(512 + n, 128, device=dev)
    return (torch.randn(1, n, 3072, device=dev, dtype=dt), torch.randn(1, 512, 3072, device=dev, dtype=dt),
            torch.randn(1, 3072, device=dev, dtype=dt), (freqs.cos(), freqs.sin()))


def _flux2(single: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock, Flux2TransformerBlock
        return (Flux2SingleTransformerBlock if single else Flux2TransformerBlock)(6144, 48, 128)
    return build


def _flux2_inputs(single: bool) -> Callable:
    def inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
        freqs = torch.randn(512 + n, 128, device=dev)
        mods = [torch.randn(1, (3 if single else 6) * 6144, device=dev, dtype=dt) for _ in range(1 if single else 2)]
        return (torch.randn(1, n, 6144, device=dev, dtype=dt), torch.randn(1, 512, 6144, device=dev, dtype=dt),
                *mods, (freqs.cos(), freqs.sin()))
    return inputs


def _ltx_video_block() -> nn.Module:
    from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock
    return LTXVideoTransformerBlock(2048, 32, 64, cross_attention_dim=2048)


def _ltx_video_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    pos = torch.randn(1, n, 2048, device=dev)
    return (torch.randn(1, n, 2048, device=dev, dtype=dt), torch.randn(1, 128, 2048, device=dev, dtype=dt),
            torch.randn(1, 1, 6 * 2048, device=dev, dtype=dt), (pos.cos(), pos.sin()))


def _hunyuan_double_block() -> nn.Module:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformerBlock
    return HunyuanVideoTransformerBlock(24, 128, 4.0, qk_norm="rms_norm")


def _hunyuan_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    pos = torch.randn(n, 128, device=dev)
    return (torch.randn(1, n, 3072, device=dev, dtype=dt), torch.randn(1, 256, 3072, device=dev, dtype=dt),
            torch.randn(1, 3072, device=dev, dtype=dt), None, (pos.cos(), pos.sin()))


def _llama_layer() -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      attn_implementation="sdpa")
    return LlamaDecoderLayer(cfg, layer_idx=0)


def _decoder_inputs(width: int) -> Callable:
    """A transformers decoder layer's call as its model makes it: hidden states, no mask, ids or cache, and the
    128-wide rotary tables."""
    def inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
        freqs = torch.randn(1, n, 128, device=dev)
        return (torch.randn(1, n, width, device=dev, dtype=dt), None, None, None, False,
                (freqs.cos().to(dt), freqs.sin().to(dt)))
    return inputs


def _h3_block() -> nn.Module:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    return MiniMaxH3TransformerBlock(5376, 56, 128, 14336, 2688, 1e-5, 1e-5)


def _h3_block_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    pos = torch.randn(n, 96, device=dev)
    return (torch.randn(1, n, 5376, device=dev, dtype=dt), torch.randn(2, 2688, device=dev),
            torch.zeros(n, dtype=torch.long, device=dev), (pos.cos(), pos.sin()))


def _h3_model() -> nn.Module:
    from diffusers import MiniMaxH3Transformer3DModel
    return MiniMaxH3Transformer3DModel(num_layers=2, num_refiner_layers=2)


def _h3_model_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    """A 10 s clip's layout: 512 text rows, 2,000 audio rows, the rest video (4,096 conditioning rows at t=0)."""
    text, audio = 512, 2000
    idx = torch.arange(n, device=dev)
    tags = torch.zeros(n, dtype=torch.long, device=dev)
    tags[:text], tags[text:text + audio] = 1, 2
    ts = torch.ones(n, dtype=torch.long, device=dev)
    ts[text + audio:text + audio + 4096] = 0
    video = n - text - audio
    return (torch.randn(1, video, 96, device=dev, dtype=dt), torch.randn(1, audio, 32, device=dev, dtype=dt),
            torch.randn(1, text, 5120, device=dev, dtype=dt), torch.tensor([0.0, 0.6], device=dev), ts, tags,
            torch.zeros(n, 3, dtype=torch.long, device=dev), idx[text + audio:], idx[text:text + audio], idx[:text])


def _ltx2_model_of(layers: int) -> nn.Module:
    from diffusers import LTX2VideoTransformer3DModel
    return LTX2VideoTransformer3DModel(num_layers=layers)   # defaults: LTX-2 (4096-wide video, 2048-wide audio)


def _ltx2_model() -> nn.Module:
    return _ltx2_model_of(48)


def _ltx2_model_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    """The image-to-video call: a timestep per video row (the first latent frame clean), 1,024 text tokens, 25 audio
    rows a second of 24 fps video; ``n`` video rows as latent frames of 34 x 60 (1920 x 1088) where they divide."""
    f, h, w = (n // 2040, 34, 60) if n % 2040 == 0 else (1, 1, n)
    audio = max(2, round((f - 1) * 8 / 24 * 25) + 1)
    ts = torch.full((1, n), 700.0, device=dev)
    ts[:, :h * w] = 0.0
    with torch.device("meta"):   # the coordinates as the pipeline builds and passes them (its model's ropes)
        ropes = _ltx2_model_of(1)
    video_coords = ropes.rope.prepare_video_coords(1, f, h, w, dev)
    audio_coords = ropes.audio_rope.prepare_audio_coords(1, audio, dev)
    return (torch.randn(1, n, 128, device=dev, dtype=dt), torch.randn(1, audio, 128, device=dev, dtype=dt),
            torch.randn(1, 1024, 3840, device=dev, dtype=dt), torch.randn(1, 1024, 3840, device=dev, dtype=dt), ts,
            torch.tensor([700.0], device=dev), torch.tensor([0.7], device=dev), None, None, None, f, h, w, 24.0,
            audio, video_coords, audio_coords)


def _llama_lm() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, num_hidden_layers=32, max_position_embeddings=1 << 21, rope_theta=500000.0,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _llama_lm_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    return (torch.zeros(1, n, dtype=torch.long, device=dev),)


def _wan_model() -> nn.Module:
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(num_layers=40)   # defaults: Wan2.1-14B T2V (5120 wide, 40 heads, ffn 13824)


def wan_latent(n: int) -> tuple[int, int, int]:
    """(frames, height, width) of a latent with ``n`` rows at 1x2x2 patches: the fewest frames whose patch grid fits
    128 x 128, the grid as square as the count allows."""
    for frames in range(1, n + 1):
        if n % frames or n // frames > 128 * 128:
            continue
        per = n // frames
        rows = max(d for d in range(1, int(per ** 0.5) + 1) if per % d == 0)
        if per // rows <= 1024:   # the model's rotary tables reach 1,024 patches per axis
            return frames, 2 * rows, 2 * (per // rows)
    raise ValueError(f"{n} tokens make no Wan latent grid (a frame count times a patch grid of at most 128 x 128): "
                     "pick a multiple of 1,024, such as 32768, 75776 or 217088")


def _wan_model_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    f, h, w = wan_latent(n)
    return (torch.randn(1, 16, f, h, w, device=dev, dtype=dt), torch.tensor([500], device=dev),
            torch.randn(1, 512, 4096, device=dev, dtype=dt))


def _qwenimage_block() -> nn.Module:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
    return QwenImageTransformerBlock(3072, 24, 128)


def _qwenimage_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    """As QwenImagePipeline calls it: a padded prompt's text mask (the last 38 of 512 tokens padding)."""
    mask = torch.ones(1, 512, dtype=torch.bool, device=dev)
    mask[:, 474:] = False
    ang = torch.rand(512 + n, 64, device=dev) * 6.2831853
    rot = torch.polar(torch.ones_like(ang), ang)
    return (torch.randn(1, n, 3072, device=dev, dtype=dt), torch.randn(1, 512, 3072, device=dev, dtype=dt), mask,
            torch.randn(1, 3072, device=dev, dtype=dt), (rot[:n], rot[n:]))


def _zimage_block() -> nn.Module:
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock
    return ZImageTransformerBlock(0, 3840, 30, 30, 1e-5, True)


def _zimage_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    ang = torch.rand(1, n, 64, device=dev) * 6.2831853
    return (torch.randn(1, n, 3840, device=dev, dtype=dt), None, torch.polar(torch.ones_like(ang), ang),
            torch.randn(1, 256, device=dev, dtype=dt))


def _qwen3_moe_layer() -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer
    cfg = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                         attn_implementation="sdpa", experts_implementation="grouped_mm")   # from_pretrained's choice
    return Qwen3MoeDecoderLayer(cfg, layer_idx=0)


def _ltx2_block() -> nn.Module:
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock
    return LTX2VideoTransformerBlock(4096, 32, 128, 4096, 2048, 32, 64, 2048)


def _ltx2_block_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    """As the LTX-2 model hands a block the image-to-video call (a timestep per video row: per-row modulation, the
    cross-attention's scale/shift and gate per row), 1,024 text tokens, 834 audio rows (800 frames' worth)."""
    audio = 834

    def pair(rows: int, width: int) -> tuple:
        ang = torch.rand(1, rows, width, device=dev)
        return ang.cos(), ang.sin()
    return (torch.randn(1, n, 4096, device=dev, dtype=dt), torch.randn(1, audio, 2048, device=dev, dtype=dt),
            torch.randn(1, 1024, 4096, device=dev, dtype=dt), torch.randn(1, 1024, 2048, device=dev, dtype=dt),
            torch.randn(1, n, 6 * 4096, device=dev, dtype=dt), torch.randn(1, 1, 6 * 2048, device=dev, dtype=dt),
            torch.randn(1, n, 4 * 4096, device=dev, dtype=dt), torch.randn(1, 1, 4 * 2048, device=dev, dtype=dt),
            torch.randn(1, n, 4096, device=dev, dtype=dt), torch.randn(1, 1, 2048, device=dev, dtype=dt), None, None,
            pair(n, 4096), pair(audio, 2048), pair(n, 2048), pair(audio, 2048))


def _bytes(elems_per_token: int) -> Callable[[torch.dtype], float]:
    return lambda dt: elems_per_token * torch.empty((), dtype=dt).element_size()


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("wan-14b-block", "Wan2.1-14B WanTransformerBlock (diffusers): dim 5120, ffn 13824, 40 heads",
           _wan_block(5120, 13824, 40), _wan_inputs(5120, 40), _bytes(3 * 5120)),
    Family("wan-14b-model", "Wan2.1-14B WanTransformer3DModel (diffusers): 40 layers, 5120 wide, 512 text tokens; the "
           "whole forward planned (its hidden state, rotary tables and head beside each block)",
           _wan_model, _wan_model_inputs, _bytes(3 * 5120)),
    Family("wan-1.3b-block", "Wan2.1-1.3B WanTransformerBlock (diffusers): dim 1536, ffn 8960, 12 heads",
           _wan_block(1536, 8960, 12), _wan_inputs(1536, 12), _bytes(3 * 1536)),
    Family("flux-double-block", "Flux.1 FluxTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
           _flux(False), _flux_inputs, _bytes(3 * 3072)),
    Family("flux-single-block", "Flux.1 FluxSingleTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
           _flux(True), _flux_inputs, _bytes(3 * 3072)),
    Family("flux2-double-block", "FLUX.2 Flux2TransformerBlock (diffusers): dim 6144, 48 heads, 512 text tokens",
           _flux2(False), _flux2_inputs(False), _bytes(3 * 6144)),
    Family("flux2-single-block", "FLUX.2 Flux2SingleTransformerBlock (diffusers): dim 6144, 48 heads, 512 text "
           "tokens", _flux2(True), _flux2_inputs(True), _bytes(3 * 6144)),
    Family("ltx-video-block", "LTX-Video LTXVideoTransformerBlock (diffusers): dim 2048, 32x64 heads, 128 text tokens",
           _ltx_video_block, _ltx_video_inputs, _bytes(3 * 2048)),
    Family("ltx2-block", "LTX-2 LTX2VideoTransformerBlock (diffusers): 4096-wide video over 32x128 heads, 2048-wide "
           "audio (834 rows), 1,024 text tokens, image-to-video (per-row modulation)", _ltx2_block,
           _ltx2_block_inputs, _bytes(3 * 4096)),
    Family("hunyuan-double-block", "HunyuanVideo HunyuanVideoTransformerBlock (diffusers): dim 3072, 24x128 heads, "
           "256 text tokens", _hunyuan_double_block, _hunyuan_inputs, _bytes(3 * 3072)),
    Family("qwenimage-block", "Qwen-Image QwenImageTransformerBlock (diffusers): dim 3072, 24x128 heads, 512 text "
           "tokens with the padded prompt's mask as its pipeline passes it", _qwenimage_block, _qwenimage_inputs,
           _bytes(3 * 3072)),
    Family("zimage-block", "Z-Image ZImageTransformerBlock (diffusers): dim 3840, 30x128 heads, rotary in an autocast "
           "region", _zimage_block, _zimage_inputs, _bytes(3 * 3840)),
    Family("h3-block", "MiniMax-H3 MiniMaxH3TransformerBlock (diffusers): 5376 wide, 56x128 heads, SwiGLU 14336",
           _h3_block, _h3_block_inputs, _bytes(5376 + 2 * 7168)),
    Family("h3-model", "MiniMaxH3Transformer3DModel (diffusers) at real width, 2 layers: 512 text and 2,000 audio "
           "rows, the rest video", _h3_model, _h3_model_inputs, _bytes(5376 + 2 * 7168)),
    Family("ltx2-model", "LTX2VideoTransformer3DModel (diffusers) at real width, 48 layers, image-to-video (a "
           "timestep per video row); --tokens counts video rows (2,040 a latent frame at 1920x1088)", _ltx2_model,
           _ltx2_model_inputs, _bytes(4096 * 3 + 2048 * 2)),
    Family("llama3-8b-layer", "Llama-3-8B LlamaDecoderLayer (transformers, sdpa): 4096 hidden, 32/8 heads",
           _llama_layer, _decoder_inputs(4096), _bytes(4096 + 2 * 1024)),
    Family("qwen3-moe-layer", "Qwen3-30B-A3B Qwen3MoeDecoderLayer (transformers, sdpa): 2048 hidden, 32/4 heads, 128 "
           "experts of 768, 8 a token", _qwen3_moe_layer, _decoder_inputs(2048), _bytes(2048 + 2 * 512)),
    Family("llama3-8b-model", "Llama-3-8B LlamaForCausalLM (transformers, sdpa), 32 layers: a prefill as generate "
           "runs it (no cache, the last position's logits); the whole forward planned", _llama_lm, _llama_lm_inputs,
           _bytes(4096 + 2 * 1024), {"use_cache": False, "logits_to_keep": 1}),
]}


def on_meta(family: Family, tokens: int, dtype: torch.dtype) -> tuple[nn.Module, tuple]:
    """The family's module and inputs with no storage behind them: planning without allocating anything."""
    with torch.device("meta"):
        module = family.build().to(dtype).eval()
    inputs = family.inputs(tokens, torch.device("meta"), dtype)
    return module, inputs
