"""Tiny random-weight diffusers transformer blocks with realistic inputs, for the generic (captured-graph) path: the
tests, the catalogue script and the GPU benchmark build their blocks from here.

Every ``Case`` has ``build()`` (a fresh block in eval mode; seed before calling for repeatable weights) and
``inputs(n, device, dtype)`` -> ``(args, kwargs)`` for a call with ``n`` image/video rows. diffusers is imported
inside the builders only, so this module imports without it. Shapes follow what each model's forward hands its
blocks (read from diffusers 0.42.1).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

TEXT = 7   # text (encoder) tokens in every case


@dataclass(frozen=True)
class Case:
    name: str
    cls_path: str                                                       # "diffusers.models....:ClassName"
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device, torch.dtype], tuple[tuple, dict]]
    note: str = ""
    row_output: int | None = 0        # which flat output holds the n rows (None: the output is one tensor)
    streams: bool = True              # whether the generic path is expected to stream it (else: stays stock)


def _cls(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def _eval(m: nn.Module) -> nn.Module:
    return m.eval()


def _r(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype)


def _pair(*shape, device, dtype):
    """A rotary (cos, sin) pair of random tables of this shape."""
    return _r(*shape, device=device, dtype=dtype), _r(*shape, device=device, dtype=dtype)


CASES: dict[str, Case] = {}


def _add(name, cls_path, ctor, inputs, note="", row_output=0, streams=True):
    def build():
        return _eval(ctor(_cls(cls_path)))
    CASES[name] = Case(name, cls_path, build, inputs, note, row_output, streams)


T = "diffusers.models.transformers."

# -- MiniMax-H3: per-row AdaLN indices, rotary per row ----------------------------------------------------------
_add("minimax_h3", T + "transformer_minimax_h3:MiniMaxH3TransformerBlock",
     lambda c: c(64, 4, 16, 128, 32, 1e-6, 1e-6),
     lambda n, device, dtype: ((_r(1, n, 64, device=device, dtype=dtype), _r(2, 32, device=device, dtype=dtype),
                                torch.randint(0, 6, (n,), device=device),
                                (_r(n, 16, device=device, dtype=dtype), _r(n, 16, device=device, dtype=dtype))), {}),
     row_output=None)

# -- HunyuanVideo: double stream (joint text+image attention), single stream (text joined inside) --------------
_add("hunyuan_video_double", T + "transformer_hunyuan_video:HunyuanVideoTransformerBlock",
     lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_r(1, n, 64, device=device, dtype=dtype), _r(1, TEXT, 64, device=device, dtype=dtype),
                                _r(1, 64, device=device, dtype=dtype), None,
                                (_r(n, 16, device=device, dtype=dtype), _r(n, 16, device=device, dtype=dtype))), {}),
     note="attention_mask=None (the model passes a [B,1,1,N+T] key mask: see hunyuan_video_double_keymask)")
_add("hunyuan_video_single", T + "transformer_hunyuan_video:HunyuanVideoSingleTransformerBlock",
     lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_r(1, n, 64, device=device, dtype=dtype), _r(1, TEXT, 64, device=device, dtype=dtype),
                                _r(1, 64, device=device, dtype=dtype), None,
                                (_r(n, 16, device=device, dtype=dtype), _r(n, 16, device=device, dtype=dtype))), {}))

# -- LTX-Video: per-call AdaLN table, rotary over the whole inner width, cross-attention to text ---------------
_add("ltx_video", T + "transformer_ltx:LTXVideoTransformerBlock",
     lambda c: c(64, 4, 16, 64),
     lambda n, device, dtype: ((_r(1, n, 64, device=device, dtype=dtype), _r(1, TEXT, 64, device=device, dtype=dtype),
                                _r(1, 1, 6 * 64, device=device, dtype=dtype),
                                (_r(1, n, 64, device=device, dtype=dtype), _r(1, n, 64, device=device, dtype=dtype))),
                               {}),
     row_output=None)

# -- LTX-2: a video stream and an audio stream, cross-attention both ways (audio queries against the video rows'
#    K/V); per-token timesteps (image-to-video) make the modulation tables per row --------------------------------
def _ltx2_inputs(n, device, dtype, audio=12):
    r = lambda *s: _r(*s, device=device, dtype=dtype)  # noqa: E731
    kw = dict(hidden_states=r(1, n, 64), audio_hidden_states=r(1, audio, 32), encoder_hidden_states=r(1, TEXT, 64),
              audio_encoder_hidden_states=r(1, TEXT, 32), temb=r(1, n, 6 * 64), temb_audio=r(1, 1, 6 * 32),
              temb_ca_scale_shift=r(1, n, 4 * 64), temb_ca_audio_scale_shift=r(1, 1, 4 * 32),
              temb_ca_gate=r(1, n, 64), temb_ca_audio_gate=r(1, 1, 32),
              video_rotary_emb=_pair(1, n, 64, device=device, dtype=dtype),
              audio_rotary_emb=_pair(1, audio, 32, device=device, dtype=dtype),
              ca_video_rotary_emb=_pair(1, n, 32, device=device, dtype=dtype),
              ca_audio_rotary_emb=_pair(1, audio, 32, device=device, dtype=dtype))
    return (), kw


_add("ltx2", T + "transformer_ltx2:LTX2VideoTransformerBlock",
     lambda c: c(64, 4, 16, 64, 32, 2, 16, 32),
     _ltx2_inputs, note="per-token modulation (temb [1, n, 6*dim]), as the image-to-video pipeline's call builds it")

# -- Wan 2.1 ------------------------------------------------------------------------------------------------------
_add("wan", T + "transformer_wan:WanTransformerBlock",
     lambda c: c(64, 128, 4, cross_attn_norm=True),
     lambda n, device, dtype: ((_r(1, n, 64, device=device, dtype=dtype), _r(1, TEXT, 64, device=device, dtype=dtype),
                                _r(1, 6, 64, device=device, dtype=dtype),
                                _pair(1, n, 1, 16, device=device, dtype=dtype)),
                               {}),
     row_output=None)

# -- Flux.1: rotary over text + image rows (text first) ------------------------------------------------------
def _flux_inputs(n, device, dtype):
    return ((_r(1, n, 64, device=device, dtype=dtype), _r(1, TEXT, 64, device=device, dtype=dtype),
             _r(1, 64, device=device, dtype=dtype),
             (_r(TEXT + n, 16, device=device, dtype=dtype), _r(TEXT + n, 16, device=device, dtype=dtype))), {})


_add("flux_double", T + "transformer_flux:FluxTransformerBlock", lambda c: c(64, 4, 16), _flux_inputs, row_output=1)
_add("flux_single", T + "transformer_flux:FluxSingleTransformerBlock", lambda c: c(64, 4, 16), _flux_inputs,
     row_output=1)


# -- breadth: more diffusers blocks -------------------------------------------------------------------------------
def _x(n, device, dtype, d=64):
    return _r(1, n, d, device=device, dtype=dtype)


def _text_mask(device, padding=3):
    """[1, TEXT] bool: the text tokens a padded prompt holds (its last ``padding`` tokens padding)."""
    mask = torch.ones(1, TEXT, dtype=torch.bool, device=device)
    mask[:, TEXT - padding:] = False
    return mask


def _txt(device, dtype, d=64):
    return _r(1, TEXT, d, device=device, dtype=dtype)


def _cs(rows, d, device, dtype):
    return (_r(rows, d, device=device, dtype=dtype), _r(rows, d, device=device, dtype=dtype))


def _cplx(shape, device):
    ang = torch.rand(*shape, device=device) * 6.2831853
    return torch.polar(torch.ones_like(ang), ang)


_add("cogvideox", T + "cogvideox_transformer_3d:CogVideoXBlock", lambda c: c(64, 4, 16, 32),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 32, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}))
_add("sd3_joint", "diffusers.models.attention:JointTransformerBlock", lambda c: c(64, 4, 16, qk_norm="rms_norm"),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype)), {}),
     row_output=1)
_add("sd35_joint_dual", "diffusers.models.attention:JointTransformerBlock",
     lambda c: c(64, 4, 16, qk_norm="rms_norm", use_dual_attention=True),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype)), {}),
     row_output=1, note="SD3.5: a second, image-only self-attention")
_add("sd3_single", T + "transformer_sd3:SD3SingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 64, device=device, dtype=dtype)), {}), row_output=None)
_add("pixart", "diffusers.models.attention:BasicTransformerBlock",
     lambda c: c(64, 4, 16, cross_attention_dim=64, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                 norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, attention_bias=True),
     lambda n, device, dtype: ((_x(n, device, dtype),), dict(
         encoder_hidden_states=_txt(device, dtype),
         encoder_attention_mask=torch.zeros(1, 1, TEXT, device=device, dtype=dtype).masked_fill(
             torch.arange(TEXT, device=device) >= TEXT - 2, -10000.0),
         timestep=_r(1, 6 * 64, device=device, dtype=dtype))), row_output=None,
     note="PixArt-alpha/sigma: ada_norm_single, cross-attention with a text key bias")
_add("auraflow_joint", T + "auraflow_transformer_2d:AuraFlowJointTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype)), {}),
     row_output=1)
_add("auraflow_single", T + "auraflow_transformer_2d:AuraFlowSingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 64, device=device, dtype=dtype)), {}), row_output=None)
_add("lumina2", T + "transformer_lumina2:Lumina2TransformerBlock", lambda c: c(64, 4, 2, 16, None, 1e-5),
     lambda n, device, dtype: ((_x(n, device, dtype), None, _cplx((1, n, 8), device),
                                _r(1, 64, device=device, dtype=dtype)), {}), row_output=None,
     note="joint text+image sequence, complex rotary; attention_mask=None (all rows valid)")
_add("qwenimage", T + "transformer_qwenimage:QwenImageTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), None,
                                _r(1, 64, device=device, dtype=dtype),
                                (_cplx((n, 8), device), _cplx((TEXT, 8), device))), {}), row_output=1)
_add("qwenimage_text_mask", T + "transformer_qwenimage:QwenImageTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _text_mask(device),
                                _r(1, 64, device=device, dtype=dtype),
                                (_cplx((n, 8), device), _cplx((TEXT, 8), device))), {}), row_output=1,
     note="encoder_hidden_states_mask as QwenImagePipeline passes it (the last 3 text tokens padding): the "
          "processor joins it with ones over the image rows, a key mask built once over every row")
_add("chroma_double", T + "transformer_chroma:ChromaTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 12, 64, device=device, dtype=dtype),
                                _cs(TEXT + n, 16, device, dtype)), {}), row_output=1)
_add("chroma_single", T + "transformer_chroma:ChromaSingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 3, 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}), row_output=None,
     note="text and image rows joined before the block: every row dynamic")
_add("cosmos", T + "transformer_cosmos:CosmosTransformerBlock", lambda c: c(4, 16, 64, adaln_lora_dim=32),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 1, 64, device=device, dtype=dtype),
                                _r(1, 1, 3 * 64, device=device, dtype=dtype), _cs(n, 16, device, dtype)), {}),
     row_output=None)
_add("skyreels_v2", T + "transformer_skyreels_v2:SkyReelsV2TransformerBlock", lambda c: c(64, 128, 4),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 6, 64, device=device, dtype=dtype),
                                _pair(1, n, 1, 16, device=device, dtype=dtype),
                                None), {}), row_output=None)
_add("skyreels_v2_per_token", T + "transformer_skyreels_v2:SkyReelsV2TransformerBlock", lambda c: c(64, 128, 4),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype),
                                _r(1, 6, n, 64, device=device, dtype=dtype),
                                _pair(1, n, 1, 16, device=device, dtype=dtype),
                                None), {}), row_output=None, note="diffusion forcing: a timestep embedding per row")
_add("hunyuan_video15", T + "transformer_hunyuan_video15:HunyuanVideo15TransformerBlock", lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _text_mask(device), _cs(n, 16, device, dtype)), {}),
     note="its processor pads the text mask (the last 3 tokens padding, as the model's reordering leaves them) over "
          "the image rows, repeats it over every query row and ands it with its transpose: each Q chunk's rows of "
          "that [S, S] mask built alone")
_add("flux2_double", T + "transformer_flux2:Flux2TransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 6 * 64, device=device, dtype=dtype),
                                _r(1, 6 * 64, device=device, dtype=dtype), _cs(TEXT + n, 16, device, dtype)), {}),
     row_output=1)
_add("flux2_single", T + "transformer_flux2:Flux2SingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 3 * 64, device=device, dtype=dtype),
                                _cs(TEXT + n, 16, device, dtype)), {}), row_output=None,
     note="returns the joined text + image rows")
_add("zimage", T + "transformer_z_image:ZImageTransformerBlock", lambda c: c(0, 64, 4, 4, 1e-5, True),
     lambda n, device, dtype: ((_x(n, device, dtype), None, _cplx((1, n, 8), device),
                                _r(1, 64, device=device, dtype=dtype)), {}), row_output=None,
     note="rotary inside torch.amp.autocast(enabled=False): its ops taken into the graph (autocast is off)")
_add("easyanimate", T + "transformer_easyanimate:EasyAnimateTransformerBlock", lambda c: c(64, 4, 16, 64),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}))
_add("cogview4", T + "transformer_cogview4:CogView4TransformerBlock", lambda c: c(64, 4, 16, 64),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}))
_add("cogview3plus", T + "transformer_cogview3plus:CogView3PlusTransformerBlock", lambda c: c(64, 4, 16, 64),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype)), {}))
_add("hunyuan_image_double", T + "transformer_hunyuanimage:HunyuanImageTransformerBlock", lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                None, _cs(n, 16, device, dtype)), {}))
_add("hunyuan_image_single", T + "transformer_hunyuanimage:HunyuanImageSingleTransformerBlock", lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                None, _cs(n, 16, device, dtype)), {}))
_add("hunyuan_dit", T + "hunyuan_transformer_2d:HunyuanDiTBlock", lambda c: c(64, 4, cross_attention_dim=64),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}), row_output=None)
_add("longcat_image", T + "transformer_longcat_image:LongCatImageTransformerBlock", lambda c: c(64, 4, 16),
     _flux_inputs, row_output=1)
_add("ovis_image", T + "transformer_ovis_image:OvisImageTransformerBlock", lambda c: c(64, 4, 16),
     _flux_inputs, row_output=1)
_add("bria", T + "transformer_bria:BriaTransformerBlock", lambda c: c(64, 4, 16), _flux_inputs, row_output=1)
_add("allegro", T + "transformer_allegro:AllegroTransformerBlock",
     lambda c: c(64, 4, 16, cross_attention_dim=64, activation_fn="gelu-approximate"),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 6 * 64, device=device, dtype=dtype)),
                               {}), row_output=None, note="image_rotary_emb=None")
_add("wan_vace", T + "transformer_wan_vace:WanVACETransformerBlock",
     lambda c: c(64, 128, 4, apply_input_projection=True, apply_output_projection=True),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _x(n, device, dtype),
                                _r(1, 6, 64, device=device, dtype=dtype),
                                _pair(1, n, 1, 16, device=device, dtype=dtype)),
                               {}))
# rows on the image plane (height, width as ints): linear attention's state contracted over every row in phase KV,
# the MLP's 3x3 depthwise convolution over the plane run on each chunk widened by a line above and below
_add("sana", T + "sana_transformer:SanaTransformerBlock",
     lambda c: c(64, 4, 16, num_cross_attention_heads=4, cross_attention_head_dim=16, cross_attention_dim=64),
     lambda n, device, dtype: ((_x(n, device, dtype),), dict(encoder_hidden_states=_txt(device, dtype),
                                                              timestep=_r(1, 6 * 64, device=device, dtype=dtype),
                                                              height=n // 20, width=20)),
     row_output=None, note="GLUMBConv MLP: a 3x3 convolution over the image plane (a halo of whole lines); linear "
                           "attention (a contraction over every row)")
# stays stock: the valid text tokens are picked with nonzero (a data-dependent length); its joint attention streams
# as a part (integrations.diffusers.mochi), and its feed-forward
_add("mochi", T + "transformer_mochi:MochiTransformerBlock", lambda c: c(64, 4, 16, 32),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype, 32), _r(1, 64, device=device, dtype=dtype),
                                torch.ones(1, TEXT, dtype=torch.bool, device=device),
                                _pair(n, 4, 8, device=device, dtype=dtype)), {}),
     streams=False, note="the processor selects valid text tokens with nonzero: a data-dependent sequence length")
# HunyuanVideo as its model calls it, with a [B, 1, 1, N + T] key mask over the joint rows (padded text masked),
# given whole to every Q chunk
_add("hunyuan_video_double_keymask", T + "transformer_hunyuan_video:HunyuanVideoTransformerBlock",
     lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _key_mask(n, device), _cs(n, 16, device, dtype)), {}),
     note="a [B, 1, 1, N + T] key mask over the joint rows (the last 3 text tokens padding)")


def _key_mask(n: int, device) -> torch.Tensor:
    mask = torch.ones(1, 1, 1, n + TEXT, dtype=torch.bool, device=device)
    mask[..., n + TEXT - 3:] = False
    return mask


# -- more breadth: copies and variants of the blocks above -------------------------------------------------------
def _wan_inputs(n, device, dtype):
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, 6, 64, device=device, dtype=dtype),
             _pair(1, n, 1, 16, device=device, dtype=dtype)), {})


_add("chronoedit", T + "transformer_chronoedit:WanTransformerBlock", lambda c: c(64, 128, 4, cross_attn_norm=True),
     _wan_inputs, row_output=None, note="ChronoEdit's copy of the Wan block")
_add("wan_animate", T + "transformer_wan_animate:WanTransformerBlock", lambda c: c(64, 128, 4, cross_attn_norm=True),
     _wan_inputs, row_output=None, note="Wan-Animate's copy of the Wan block")
_add("longcat_image_single", T + "transformer_longcat_image:LongCatImageSingleTransformerBlock",
     lambda c: c(64, 4, 16), _flux_inputs, row_output=1)
_add("ovis_image_single", T + "transformer_ovis_image:OvisImageSingleTransformerBlock", lambda c: c(64, 4, 16),
     _flux_inputs, row_output=1)
_add("bria_single", T + "transformer_bria:BriaSingleTransformerBlock", lambda c: c(64, 4, 16), _flux_inputs,
     row_output=1)
_add("bria_fibo", T + "transformer_bria_fibo:BriaFiboTransformerBlock", lambda c: c(64, 4, 16), _flux_inputs,
     row_output=1)
_add("bria_fibo_single", T + "transformer_bria_fibo:BriaFiboSingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}), row_output=None,
     note="text and image rows joined before the block: every row dynamic")
_add("consisid", T + "consisid_transformer_3d:ConsisIDBlock", lambda c: c(64, 4, 16, 32),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 32, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}))


_I2V = ("HunyuanVideo I2V: the first frame's rows (num_tokens) take their own modulation, sliced off the rows at a "
        "fixed count and joined back: each chunk takes its part of either side (graph.fixed_row_slices); chunks of "
        "at least num_tokens + 2 rows, where the capture holds")


def _hv_token_replace(n, device, dtype):
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype), None,
             _cs(n, 16, device, dtype)), dict(token_replace_emb=_r(1, 64, device=device, dtype=dtype), num_tokens=20))


_add("hunyuan_video_i2v_double", T + "transformer_hunyuan_video:HunyuanVideoTokenReplaceTransformerBlock",
     lambda c: c(4, 16, 2.0), _hv_token_replace, note=_I2V)
_add("hunyuan_video_i2v_single", T + "transformer_hunyuan_video:HunyuanVideoTokenReplaceSingleTransformerBlock",
     lambda c: c(4, 16, 2.0), _hv_token_replace, note=_I2V)


def _refiner_mask(n, device):
    """The [B, 1, N, N] mask HunyuanVideo's token refiner builds from its text mask (last 3 tokens padding)."""
    valid = torch.ones(1, n, dtype=torch.bool, device=device)
    valid[:, n - 3:] = False
    m1 = valid.view(1, 1, 1, n).repeat(1, 1, n, 1)
    mask = m1 & m1.transpose(2, 3)
    mask[:, :, :, 0] = True
    return mask


def _refiner_block_inputs(n, device, dtype):
    return ((_x(n, device, dtype), _r(1, 64, device=device, dtype=dtype), _refiner_mask(n, device)), {})


def _refiner_inputs(n, device, dtype):
    valid = torch.ones(1, n, dtype=torch.long, device=device)
    valid[:, n - 3:] = 0
    return ((_x(n, device, dtype, 32), torch.tensor([500], device=device), valid), {})


for _fam, _mod in (("hunyuan_video", "transformer_hunyuan_video:HunyuanVideo"),
                   ("hunyuan_video15", "transformer_hunyuan_video15:HunyuanVideo15"),
                   ("hunyuan_image", "transformer_hunyuanimage:HunyuanImage")):
    _add(f"{_fam}_refiner_block", T + _mod + "IndividualTokenRefinerBlock", lambda c: c(4, 16), _refiner_block_inputs,
         row_output=None,
         note="the text token refiner's block (its rows are text tokens) with the refiner's [B, 1, N, N] padding "
              "mask, which diffusers' prepare_attention_mask repeats over heads (repeat_interleave + view) before "
              "SDPA: each Q chunk's rows of it built alone")
    _add(f"{_fam}_refiner", T + _mod + "TokenRefiner", lambda c: c(32, 4, 16, 2), _refiner_inputs, row_output=None,
         streams=False, note="the whole text refiner: pools the text over its rows (a masked mean) for its timestep "
                             "embedding, then runs its refiner blocks (see the _refiner_block case)")


# -- more breadth: image and video DiTs ---------------------------------------------------------------------------
_add("lumina_next", T + "lumina_nextdit2d:LuminaNextDiTBlock", lambda c: c(64, 4, 2, 16, None, 1e-5, True, 32),
     lambda n, device, dtype: ((_x(n, device, dtype), torch.ones(1, n, dtype=torch.int32, device=device),
                                _cplx((1, n, 8), device), _txt(device, dtype, 32),
                                torch.ones(1, TEXT, dtype=torch.bool, device=device),
                                _r(1, 64, device=device, dtype=dtype)), dict(cross_attention_kwargs={})),
     row_output=None,
     note="the patch embedder's all-ones [B, N] key mask over the image rows, which its processor expands to "
          "[B, H, N, N] before SDPA: each Q chunk's rows of it built alone")


def _omnigen_mask(n, device, dtype, cond=16):
    """OmniGen's mask: causal over the condition rows, the output image's rows bidirectional among themselves."""
    allowed = torch.ones(n, n, device=device).tril()
    allowed[cond:, cond:] = 1
    return ((1 - allowed) * torch.finfo(dtype).min)[None, None].to(dtype)


_add("omnigen", T + "transformer_omnigen:OmniGenBlock", lambda c: c(64, 4, 4, 128, 1e-5),
     lambda n, device, dtype: ((_x(n, device, dtype), _omnigen_mask(n, device, dtype), _cs(n, 16, device, dtype)),
                               {}), row_output=None,
     note="an additive [B, 1, N, N] mask: causal over the first 16 (condition) rows, the image rows bidirectional")


def _k5_rope(rows, device, dtype):
    ang = torch.rand(1, rows, 1, 8, device=device, dtype=dtype) * 6.2831853
    c, s = ang.cos(), ang.sin()
    return torch.stack([c, -s, s, c], dim=-1).view(1, rows, 1, 8, 2, 2)


_add("kandinsky5_decoder", T + "transformer_kandinsky:Kandinsky5TransformerDecoderBlock", lambda c: c(64, 32, 128, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 32, device=device, dtype=dtype),
                                _k5_rope(n, device, dtype), None), {}), row_output=None,
     note="sparse_params=None (full attention); rotary as 2x2 rotation matrices")
_add("kandinsky5_encoder", T + "transformer_kandinsky:Kandinsky5TransformerEncoderBlock", lambda c: c(64, 32, 128, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 32, device=device, dtype=dtype),
                                _k5_rope(n, device, dtype)), {}), row_output=None,
     note="the text encoder block (its rows are text tokens)")
_add("prx", T + "transformer_prx:PRXBlock", lambda c: c(64, 4),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _k5_rope(n, device, dtype)[:, None, :, 0]), {}), row_output=None,
     note="image queries over image + text keys; rotary [B, 1, N, D/2, 2, 2]")
_add("flux3_mode", T + "transformer_flux3:Flux3ModeTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, n, 3 * 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}), row_output=None,
     note="per-mode block: modulation per row")
_add("flux3_single", T + "transformer_flux3:Flux3SingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, n, 3 * 64, device=device, dtype=dtype),
                                _r(1, TEXT, 3 * 64, device=device, dtype=dtype), _cs(TEXT + n, 16, device, dtype)),
                               {}), row_output=1, note="joint text + image rows; modulation per row")
_add("krea2", T + "transformer_krea2:Krea2TransformerBlock", lambda c: c(64, 128, 4, 2, 1e-6),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 1, 6 * 64, device=device, dtype=dtype),
                                _cs(n, 16, device, dtype)), {}), row_output=None,
     note="text and image rows joined before the block; attention_mask=None (no text padding)")
_add("ideogram4", T + "transformer_ideogram4:Ideogram4TransformerBlock", lambda c: c(64, 128, 4, 1e-6, 32),
     lambda n, device, dtype: ((_x(n, device, dtype), torch.ones(1, 1, n, n, dtype=torch.bool, device=device),
                                _pair(1, n, 16, device=device, dtype=dtype), _r(1, 1, 32, device=device, dtype=dtype)),
                               {}), row_output=None,
     note="one segment: the block-diagonal [B, 1, N, N] segment mask all true")
_add("minimax_h3_refiner", T + "transformer_minimax_h3:MiniMaxH3TokenRefinerBlock",
     lambda c: c(64, 4, 16, 128, 1e-6, 1e-6),
     lambda n, device, dtype: ((_x(n, device, dtype),), {}), row_output=None,
     note="the text token refiner's block (its rows are text tokens)")
_add("minimax_music3", T + "transformer_minimax_music3:MiniMaxMusic3TransformerBlock", lambda c: c(64, 4, 16, 128),
     lambda n, device, dtype: ((_x(n, device, dtype), _cs(n, 8, device, dtype)), {}), row_output=None,
     note="partial rotary (the first 8 of 16 dims per head)")
_add("minimax_music3_depth", T + "minimax_music3_rvq_depth_decoder:MiniMaxMusic3DepthDecoderBlock",
     lambda c: c(64, 4, 128), lambda n, device, dtype: ((_x(n, device, dtype),), {}), row_output=None)
_add("krea2_text_fusion", T + "transformer_krea2:Krea2TextFusionBlock", lambda c: c(64, 4, 2, 128, 1e-6),
     lambda n, device, dtype: ((_x(n, device, dtype),), {}), row_output=None,
     note="the text fusion block (its rows are text tokens); attention_mask=None (no text padding)")
_add("joyimage", T + "transformer_joyimage:JoyImageTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                (_cs(n, 16, device, dtype), None)), {}), row_output=0,
     note="rotary on the image rows only (rope_type without text positions)")
_add("stable_audio", T + "stable_audio_transformer:StableAudioDiTBlock",
     lambda c: c(128, 2, 1, 64, cross_attention_dim=32),
     lambda n, device, dtype: ((_x(n, device, dtype, 128),), dict(
         encoder_hidden_states=_txt(device, dtype, 32), rotary_embedding=_cs(n, 32, device, dtype))), row_output=None,
     note="the global token joined to the audio rows before the block; partial rotary (32 of 64 dims), GQA; "
          "attention_mask=None")



_add("motif_video_double", T + "transformer_motif_video:MotifVideoTransformerBlock", lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                None, _cs(n, 16, device, dtype)), {}), note="attention_mask=None")
_add("motif_video_single", T + "transformer_motif_video:MotifVideoSingleTransformerBlock", lambda c: c(4, 16, 2.0),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                None, _cs(n, 16, device, dtype)), {}), note="attention_mask=None")
_add("joyimage_edit_plus", T + "transformer_joyimage_edit_plus:JoyImageEditPlusTransformerBlock",
     lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _pair(1, n, 16, device=device, dtype=dtype)), {}), row_output=0,
     note="rotary on the image rows only, per batch element; attention_mask=None")
_add("kandinsky6_encoder", T + "transformer_kandinsky6:Kandinsky6TransformerEncoderBlock",
     lambda c: c(64, 32, 128, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 32, device=device, dtype=dtype),
                                _k5_rope(n, device, dtype)), {}), row_output=None,
     note="the text encoder block (its rows are text tokens)")
_add("hidream_double", T + "transformer_hidream_image:HiDreamImageTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), None, _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                _k5_rope(TEXT + n, device, dtype)), {}),
     note="a mixture-of-experts MLP on the image rows, run whole on each chunk's rows as one op")
_add("hidream_single", T + "transformer_hidream_image:HiDreamImageSingleTransformerBlock", lambda c: c(64, 4, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), None, None, _r(1, 64, device=device, dtype=dtype),
                                _k5_rope(n, device, dtype)), {}), row_output=None,
     note="a mixture-of-experts MLP, run whole on each chunk's rows as one op")
_add("dreamlite", T + "transformer_2d_dreamlite:BasicTransformerBlockDreamLite",
     lambda c: c(64, 4, 16, cross_attention_dim=64),
     lambda n, device, dtype: ((_x(n, device, dtype),), dict(encoder_hidden_states=_txt(device, dtype))),
     row_output=None)
_add("ace_step", T + "ace_step_transformer:AceStepTransformerBlock", lambda c: c(64, 4, 2, 16, 128),
     lambda n, device, dtype: ((_x(n, device, dtype), _cs(n, 16, device, dtype),
                                _r(1, 6, 64, device=device, dtype=dtype)),
                               dict(attention_mask=None, encoder_hidden_states=_txt(device, dtype),
                                    encoder_attention_mask=None)), row_output=None,
     note="a full-attention layer (the sliding layers take a banded mask), GQA, cross-attention to the condition")
_add("nucleus_image_dense", T + "transformer_nucleusmoe_image:NucleusMoEImageTransformerBlock",
     lambda c: c(64, 4, 16, joint_attention_dim=64, moe_enabled=False),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 64, device=device, dtype=dtype),
                                (_cplx((n, 8), device), _cplx((TEXT, 8), device))), {}), row_output=None,
     note="a dense layer (moe_enabled=False)")


# -- the rest of diffusers' block classes --------------------------------------------------------------------------
def _pad_mask(rows, device, dtype, padding=3):
    """[1, 1, rows, TEXT] of ones over the decoder rows x the text tokens, the last ``padding`` tokens zero."""
    mask = torch.ones(1, 1, rows, TEXT, device=device, dtype=dtype)
    mask[..., TEXT - padding:] = 0
    return mask


_add("t5_film_decoder", T + "t5_film_transformer:DecoderLayer", lambda c: c(64, 16, 4, 128, 0.0),
     lambda n, device, dtype: ((_x(n, device, dtype),), dict(
         conditioning_emb=_r(1, 1, 4 * 64, device=device, dtype=dtype), encoder_hidden_states=_txt(device, dtype),
         encoder_attention_mask=_pad_mask(n, device, dtype))),
     streams=False,
     note="spectrogram diffusion's FiLM decoder layer, with the [B, 1, N, T] encoder-decoder mask its model builds "
          "(ones over the decoder rows x the encoders' token masks, the last 3 tokens padding); its self-attention on "
          "diffusers' classic processor (baddbmm over an empty base, softmax, bmm) found as one attention")


def _anyflow_inputs(n, device, dtype):
    freqs = _cplx((1, 1, n, 8), device).to(torch.complex128)
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, n, 6, 64, device=device, dtype=dtype),
             {"query": freqs, "key": freqs}, None), {})


_add("anyflow", T + "transformer_anyflow:AnyFlowTransformerBlock", lambda c: c(64, 128, 4, True), _anyflow_inputs,
     row_output=None, note="per-token modulation (each frame's timestep repeated over its tokens), complex128 rotary; "
                           "attention_mask=None")

_FAR_CACHED = (16, 48)   # compressed and full-resolution tokens of the earlier chunks in the KV cache


def _anyflow_far_inputs(n, device, dtype):
    compressed, full = _FAR_CACHED
    cache = {"compressed_cache": _r(2, 1, 4, 2 * compressed, 16, device=device, dtype=dtype),
             "full_cache": _r(2, 1, 4, 2 * full, 16, device=device, dtype=dtype)}
    flag = {"num_cached_chunks": 2, "is_cache_step": False, "num_cached_compressed_tokens": compressed,
            "num_cached_full_tokens": full}
    freqs = _cplx((1, 1, compressed + full + n, 8), device).to(torch.complex128)
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, n, 6, 64, device=device, dtype=dtype),
             {"query": freqs[:, :, -n:], "key": freqs}, None, cache, flag), {})


_add("anyflow_far", T + "transformer_anyflow_far:AnyFlowTransformerBlock", lambda c: c(64, 128, 4, True, 1e-6, True),
     _anyflow_far_inputs, row_output=None, streams=False,
     note="FAR causal generation's denoising step: the chunk's rows attend to the KV cache of the earlier chunks "
          "(16 compressed + 48 full-resolution tokens) and themselves, on the flex backend (rows padded to a "
          "multiple of 128)")

_add("bria_fibo2_perceiver", T + "transformer_bria_fibo2:BriaFibo2PerceiverLayer", lambda c: c(64, 4, 32, 1e-5),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype, 32), _text_mask(device), None), {}),
     row_output=None,
     note="the Perceiver resampler's layer (its rows are gist queries): cross-attention to the text with the padded "
          "text mask the pipeline passes for a batch of prompts (the last 3 tokens padding)")

_GIST = 16   # gist tokens ahead of the image rows in Bria Fibo 2's joint sequence


def _bria_fibo2_inputs(n, device, dtype):
    noise_mask = torch.ones(1, n, dtype=torch.long, device=device)
    noise_mask[:, :_GIST] = 0
    return ((_x(n, device, dtype), None, _cplx((1, n, 8), device)), dict(
        noise_mask=noise_mask, adaln_noisy=_r(1, 64, device=device, dtype=dtype),
        adaln_clean=_r(1, 64, device=device, dtype=dtype), encoder_hidden_states=_txt(device, dtype, 32),
        encoder_attention_mask=_text_mask(device)))


_add("bria_fibo2", T + "transformer_bria_fibo2:BriaFibo2TransformerBlock",
     lambda c: c(64, 4, 1e-5, cross_attention_dim=32), _bria_fibo2_inputs, row_output=None,
     note="an injection block: 16 gist tokens then the image rows, per-token modulation picked by the noise mask, "
          "gated cross-attention to the text with a padded text mask (the last 3 tokens padding)")

_add("cosmos3", T + "transformer_cosmos3:Cosmos3VLTextMoTDecoderLayer", lambda c: c(64, 16, 4, 2, 128, False, 1e-6),
     lambda n, device, dtype: ((_r(TEXT, 64, device=device, dtype=dtype), _r(n, 64, device=device, dtype=dtype),
                                (*_cs(TEXT, 16, device, dtype), *_cs(n, 16, device, dtype))), {}),
     row_output=1,
     note="packed, unbatched [tokens, C] streams (the rows: the longest, the generation stream): a causal text "
          "(understanding) prefix, the generation rows attending to the text and themselves; GQA")


def _ernie_inputs(n, device, dtype):
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device=device)
    mask[..., n - 3:] = False
    temb = [_r(1, 1, 64, device=device, dtype=dtype).expand(n, 1, 64).contiguous() for _ in range(6)]
    return ((_r(n, 1, 64, device=device, dtype=dtype), _r(1, n, 1, 16, device=device, dtype=dtype), temb, mask), {})


_add("ernie_image", T + "transformer_ernie_image:ErnieImageSharedAdaLNBlock", lambda c: c(64, 4, 128, 1e-6),
     _ernie_inputs, row_output=None,
     note="sequence-first [S, B, C] (the rows read from dim 0 of a [rows, 1, features] input): image rows then "
          "text rows joined (every row dynamic), the model's key mask "
          "over them (the last 3 text tokens padding), modulation expanded over the rows")


def _glm_image_inputs(n, device, dtype):
    cache = _cls(T + "transformer_glm_image:GlmImageLayerKVCache")()
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, 32, device=device, dtype=dtype),
             _cs(n, 16, device, dtype), None, None), dict(kv_cache=cache))


_add("glm_image", T + "transformer_glm_image:GlmImageTransformerBlock", lambda c: c(64, 4, 16, 32), _glm_image_inputs,
     note="text-to-image: the pipeline's per-layer KV cache with no mode set (no condition images), taken as its "
          "tensors (a read cache); attention_mask=None")
_add("glm_image_no_cache", T + "transformer_glm_image:GlmImageTransformerBlock", lambda c: c(64, 4, 16, 32),
     lambda n, device, dtype: (_glm_image_inputs(n, device, dtype)[0], dict(kv_cache=None)),
     note="the model called without the pipeline's KV caches (kv_caches=None); attention_mask=None")

_HISTORY = 48   # Helios' history rows (short, mid and long memory) ahead of the current chunk


def _helios_inputs(n, device, dtype):
    temb = torch.cat([_r(1, 1, 6, 64, device=device, dtype=dtype).expand(1, _HISTORY, 6, 64),
                      _r(1, 1, 6, 64, device=device, dtype=dtype).expand(1, n - _HISTORY, 6, 64)], dim=1)
    return ((_x(n, device, dtype), _txt(device, dtype), temb, _r(1, n, 32, device=device, dtype=dtype),
             n - _HISTORY), {})


_add("helios", T + "transformer_helios:HeliosTransformerBlock",
     lambda c: c(64, 128, 4, "rms_norm_across_heads", True, 1e-6, guidance_cross_attn=True), _helios_inputs,
     row_output=None,
     note="48 history rows then the current chunk's rows (original_context_length): the history, split off at that "
          "count, skips the cross-attention and takes the t=0 modulation; each chunk takes its part of either side "
          "(graph.fixed_row_slices), in chunks of at least original_context_length + 2 rows, where the capture holds")

_add("kandinsky6_fused", T + "transformer_kandinsky6:Kandinsky6FusedTransformerDecoderBlock",
     lambda c: c(64, 32, 128, 16, 32, 32, 64, 16, True, True, True),
     lambda n, device, dtype: ((_x(n, device, dtype), _x(24, device, dtype, 32), _txt(device, dtype),
                                _txt(device, dtype, 32), (_r(1, 32, device=device, dtype=dtype),
                                                          _r(1, 32, device=device, dtype=dtype)),
                                _k5_rope(n, device, dtype)[0], _k5_rope(24, device, dtype)[0], None), {}),
     note="video rows and 24 audio tokens, cross-attention both ways with rotary (ca_rope, cross_gates, "
          "fix_modulation as released); attention_mask=None (one prompt)")


def _k6_sr_inputs(n, device, dtype):
    rows = n - n % 64   # NABLA attends in 8x8-token blocks: whole blocks only
    sta = _cls(T + "transformer_kandinsky6_sr:sliding_tile_mask")(rows // 64, 1, 1, (11, 7, 7), device)
    return ((_x(rows, device, dtype), _r(1, 32, device=device, dtype=dtype), _k5_rope(rows, device, dtype)[0],
             {"sta_mask": sta, "threshold": 0.8}), {})


_add("kandinsky6_sr", T + "transformer_kandinsky6_sr:Kandinsky6SRTransformerBlock", lambda c: c(64, 32, 128, 16),
     _k6_sr_inputs, row_output=None,
     note="NABLA sparse attention on the flex backend, its block mask chosen from the mean Q and K of every 64-row "
          "block (built once from every row's Q and K in phase KV, integrations.diffusers.flex_nabla); rows rounded "
          "down to whole 64-row (8x8 token) blocks")

_add("longcat_audio_dit", T + "transformer_longcat_audio_dit:AudioDiTBlock", lambda c: c(64, 64, 4, 16, qk_norm=True),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, 64, device=device, dtype=dtype), _txt(device, dtype)),
                               dict(mask=torch.ones(1, n, dtype=torch.bool, device=device),
                                    cond_mask=_text_mask(device), rope=_cs(n, 16, device, dtype),
                                    cond_rope=_cs(TEXT, 16, device, dtype),
                                    adaln_global_out=_r(1, 6 * 64, device=device, dtype=dtype))),
     row_output=None,
     note="the pipeline's [B, N] audio mask (all rows valid) as the self-attention's key mask (unsqueezed in the "
          "block: built whole for each Q chunk) and a per-row output mask; a padded text mask (the last 3 tokens "
          "padding); global AdaLN")


def _qwenimage21_inputs(n, device, dtype):
    cache = _cls(T + "transformer_qwenimage21:QwenImage21KVLayerCache")()
    cache.store(_r(1, TEXT, 4, 16, device=device, dtype=dtype), _r(1, TEXT, 4, 16, device=device, dtype=dtype))
    return ((_x(n, device, dtype), _r(2, 4 * 64, device=device, dtype=dtype)), dict(
        rotary_emb=_cplx((n, 8), device), target_token_mask=torch.ones(n, dtype=torch.bool, device=device),
        layer_cache=cache, kv_cache_mode="cached"))


_add("qwenimage21", T + "transformer_qwenimage21:QwenImage21TransformerBlock", lambda c: c(64, 4, 16),
     _qwenimage21_inputs, row_output=None,
     note="a decode step (kv_cache_mode='cached', every step after the first): the target image's rows attend to the "
          "cached text prefix K/V (a read cache) and themselves; modulation rows picked by the target-token mask")

_add("rfd4_proteina", T + "transformer_rfd4_proteina:RFD4ProteinaTrunkLayer",
     lambda c: c(64, 16, 4, 32, "rms_norm", True),
     lambda n, device, dtype: ((_x(n, device, dtype), _r(1, n, n, 16, device=device, dtype=dtype),
                                _x(n, device, dtype, 32), torch.ones(1, n, dtype=torch.bool, device=device)), {}),
     row_output=None, streams=False,
     note="a protein trunk layer (its rows are residues): the attention bias comes from the [B, N, N, C] pair "
          "representation; padding mask all true (one protein)")


def _sana_video_inputs(n, device, dtype):
    bias = torch.zeros(1, 1, TEXT, device=device, dtype=dtype)
    bias[..., TEXT - 3:] = -10000.0
    cos, sin = _pair(1, n, 1, 16, device=device, dtype=torch.float64)
    return ((_x(n, device, dtype),), dict(encoder_hidden_states=_txt(device, dtype), encoder_attention_mask=bias,
                                          timestep=_r(1, 1, 6 * 64, device=device, dtype=dtype), frames=4,
                                          height=n // 80, width=20, rotary_emb=(cos, sin)))


_add("sana_video", T + "transformer_sana_video:SanaVideoTransformerBlock",
     lambda c: c(64, 4, 16, 0.0, 4, 16, 64, False, mlp_ratio=2.5), _sana_video_inputs, row_output=None,
     note="linear attention (sums over every row) and a 3x3 + temporal convolution MLP (chunks of whole frames, a "
          "halo of one frame each side); the text key bias the model makes of the padded prompt mask (the last 3 "
          "tokens padding); float64 rotary tables")


def _sana_wm_block(c):
    return c(64, 4, _cls(T + "transformer_sana_wm:_SoftmaxUCPESinglePathLiteLA"), mlp_ratio=3.0, qk_norm=True,
             ffn_type="GLUMBConvTemp", linear_head_dim=16, cross_norm=True, patch_size=(1, 1, 1), cam_attn_compress=1,
             use_chunk_plucker_post_attn=True, conv_kernel_size=4, k_conv_only=True)


def _sana_wm_inputs(n, device, dtype):
    frames, height, width = 4, n // 80, 20
    rope = _cls(T + "transformer_sana_wm:SanaWMRotaryPosEmbed")(16, (1, 1, 1), 1024)((frames, height, width), device)
    c2w = torch.eye(4, device=device).repeat(frames, 1, 1)
    c2w[:, 2, 3] = torch.arange(frames, device=device) * 0.1          # the camera moving forward
    intrinsics = torch.tensor([width, width, width / 2, height / 2], device=device).expand(frames, 4)
    camera = torch.cat([c2w.flatten(1), intrinsics], dim=1)[None].to(dtype)
    rays = _cls(T + "transformer_sana_wm:_prepare_ucpe_ray_transforms")(16, camera, (frames, height, width),
                                                                        (1, 1, 1), rotary_emb=rope)
    mask = torch.ones(1, TEXT, dtype=torch.int16, device=device)
    mask[:, TEXT - 3:] = 0
    return ((_x(n, device, dtype), _r(1, 1, TEXT, 64, device=device, dtype=dtype),
             _r(1, 1, frames, 6 * 64, device=device, dtype=dtype), mask, (frames, height, width), rope, None, camera,
             rays, _x(n, device, dtype), None, None), {})


_add("sana_wm", T + "transformer_sana_wm:SanaVideoMSCamCtrlBlock", _sana_wm_block, _sana_wm_inputs, row_output=None,
     streams=False,
     note="a softmax-attention layer (every 4th; the others run a gated delta-rule recurrence over the frames) with "
          "its camera (UCPE) branch from a moving camera, per-frame modulation, a 3x3 + temporal convolution MLP; "
          "padded text mask")


def _sana_wm_refiner_block(c):
    block = c(64, 4, 16, 64, 32, 2, 16, 32)
    block.attn1.set_processor(_cls(T + "transformer_sana_wm_refiner:SanaWMLTX2RefinerAttnProcessor")())
    return block   # the refiner model swaps in this processor for its sliding-window KV cache


def _sana_wm_refiner_inputs(n, device, dtype, sink=16, history=32):
    cache = _cls(T + "transformer_sana_wm_refiner:SanaWMRefinerKVLayerCache")()
    cache.store_sink(_x(sink, device, dtype), _x(sink, device, dtype))
    cache.store_history(_x(history, device, dtype), _x(history, device, dtype))
    bias = torch.zeros(1, 1, TEXT, device=device, dtype=dtype)
    bias[..., TEXT - 3:] = -10000.0
    return ((_x(n, device, dtype), _txt(device, dtype), _r(1, 1, 6 * 64, device=device, dtype=dtype).expand(1, n, -1),
             _pair(1, n, 64, device=device, dtype=dtype)),
            dict(encoder_attention_mask=bias, sink_rotary_emb=_pair(1, sink, 64, device=device, dtype=dtype),
                 kv_cache=cache, kv_cache_mode="inject"))


_add("sana_wm_refiner", T + "transformer_sana_wm_refiner:SanaWMLTX2RefinerTransformerBlock", _sana_wm_refiner_block,
     _sana_wm_refiner_inputs, row_output=None,
     note="a denoising step of the sliding-window refiner (kv_cache_mode='inject'): the block's rows attend to the "
          "cached sink (16, re-rotated) and history (32) K/V (a read cache) and themselves; the text key bias of a "
          "padded prompt")

_add("stable_audio3", T + "transformer_stable_audio3:StableAudio3DiTBlock", lambda c: c(64, 64, 16),
     lambda n, device, dtype: ((_x(n, device, dtype), _txt(device, dtype), _r(1, 6 * 64, device=device, dtype=dtype),
                                _r(n, 8, device=device, dtype=dtype)), dict(num_memory_tokens=64)),
     row_output=None,
     note="differential attention (two softmax attentions subtracted), partial rotary; the 64 memory tokens joined "
          "to the audio rows; context_mask=None (the model drops it)")


def _wan_animate2_inputs(n, device, dtype):
    frames, hw = 4, n // 4   # generation frames: the reference frame plus those conditioned on the reference video
    cache = _cls(T + "transformer_wan_animate_2:WanAnimate2KVLayerCache")()
    cache.store(_r(1, (frames - 1) * hw, 4, 16, device=device, dtype=dtype),
                _r(1, (frames - 1) * hw, 4, 16, device=device, dtype=dtype))
    model = _cls(T + "transformer_wan_animate_2:WanAnimate2Transformer3DModel")
    grid = torch.tensor([[frames, hw // 10, 10]])
    return ((_x(n, device, dtype), _r(1, 6, 64, device=device, dtype=dtype), _txt(device, dtype), cache, "cached",
             _cplx((512, 8), device).to(torch.complex128), grid),
            dict(encoder_hidden_states_image=_r(1, 257, 64, device=device, dtype=dtype),
                 reference_rotary_emb=_cplx((512, 8), device).to(torch.complex128),
                 reference_grid_sizes=torch.tensor([[frames - 1, hw // 10, 10]]),
                 attention_mask=model.create_mask(None, frames - 1, hw, device), origin_latent_frames=frames - 1,
                 origin_latent_hw=hw))


_add("wan_animate2", T + "transformer_wan_animate_2:WanAnimate2TransformerBlock", lambda c: c(64, 128, 4, True),
     _wan_animate2_inputs, row_output=None,
     note="a generation step (kv_cache_mode='cached'): the rows packed with the cached reference K/V into 128-aligned "
          "buffers for one flex attention under the model's in-context block mask (described over the rows and the "
          "reference keys, integrations.diffusers.flex)")
