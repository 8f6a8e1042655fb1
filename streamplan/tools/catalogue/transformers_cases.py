"""Tiny random-weight transformers decoder layers with the inputs their own model hands them, for the generic
(captured-graph) path: the tests and the catalogue script build their layers from here.

Every ``Case`` has ``build()`` (a fresh layer in eval mode; seed before calling for repeatable weights) and
``inputs(n, device, dtype)`` -> ``(args, kwargs)`` for a prefill of ``n`` tokens. The inputs are not written here:
each case builds the tiny whole model (hidden 64, 4 heads, 2 KV heads where the family has them, SDPA attention),
runs it on ``n`` random token ids without a cache and without padding, and records with a forward pre-hook what the
model passes the layer (attention mask, rotary cos/sin, position ids, ...); the hidden states are then replaced by
random ones of unit scale (Llama 4's vision encoder layer: recorded from Llama4VisionModel on a random image).
transformers is imported inside the builders only, so this module imports without it.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from . import Case

VOCAB = 128
WINDOW = 32          # the sliding window of the sliding-window cases: shorter than the test's row counts

_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=8192, head_dim=16,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)

_MODELS: dict[str, tuple[nn.Module, nn.ModuleList]] = {}


def _layers(model: nn.Module) -> nn.ModuleList:
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and type(m[0]).__name__.endswith(("DecoderLayer", "Layer",
                                                                                         "Block")):
            return m
    raise LookupError(f"no list of decoder layers in {type(model).__name__}")


def _model(name: str, model_type: str, overrides: dict) -> tuple[nn.Module, nn.ModuleList]:
    """The case's tiny whole model (built once, seeded): the source of its layer and of the inputs."""
    if name not in _MODELS:
        from transformers import AutoConfig, AutoModel
        kw = {**_COMMON, **overrides}
        attn = kw.pop("attn_implementation", "sdpa")
        kw = {k: v for k, v in kw.items() if v is not None}
        cfg = AutoConfig.for_model(model_type, **kw)
        state = torch.random.get_rng_state()
        torch.manual_seed(1234)
        try:
            model = AutoModel.from_config(cfg, attn_implementation=attn).eval()
        finally:
            torch.random.set_rng_state(state)
        _MODELS[name] = (model, _layers(model))
    return _MODELS[name]


def _record(name: str, model_type: str, overrides: dict, layer: int, n: int) -> tuple[tuple, dict]:
    model, layers = _model(name, model_type, overrides)
    gen = torch.Generator().manual_seed(n)
    return _record_call(model, layers[layer], dict(input_ids=torch.randint(3, VOCAB, (1, n), generator=gen),
                                                   use_cache=False))


def _record_call(model: nn.Module, target: nn.Module, feed: dict) -> tuple[tuple, dict]:
    """What ``model(**feed)`` passes ``target`` (its forward stopped there)."""
    seen: dict[str, Any] = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)
        raise _Recorded

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**feed)
    except _Recorded:
        pass
    finally:
        handle.remove()
    return seen["args"], seen["kwargs"]


class _Recorded(Exception):
    """Stops the model's forward once the layer's inputs are recorded."""


def _move(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


def _fresh(name: str, layer: nn.Module, cls: str) -> nn.Module:
    """A copy of the model's layer with fresh weights from the caller's seed (the model's init leaves norms at one)."""
    found = copy.deepcopy(layer).eval()
    if type(found).__name__ != cls:
        raise TypeError(f"{name}: the layer is a {type(found).__name__}, not {cls}")
    with torch.no_grad():
        for pname, p in found.named_parameters():
            norm_like = p.dim() == 1 and not pname.endswith("bias")
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.1) + (1.0 if norm_like else 0.0))
    return found


CASES: dict[str, Case] = {}


def _add(name: str, family: str, cls: str, model_type: str | None = None, overrides: dict | None = None,
         layer: int = 0, note: str = "", streams: bool = True) -> None:
    model_type = model_type or family
    overrides = overrides or {}
    cls_path = f"transformers.models.{family}.modeling_{family}:{cls}"

    def build() -> nn.Module:
        _, layers = _model(name, model_type, overrides)
        return _fresh(name, layers[layer], cls)

    def inputs(n: int, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict]:
        args, kwargs = _record(name, model_type, overrides, layer, n)
        args, kwargs = _move(args, device, dtype), _move(kwargs, device, dtype)
        x = torch.randn(1, n, 64, device=device, dtype=dtype)
        if args:
            args = (x,) + tuple(args[1:])
        else:
            kwargs["hidden_states"] = x
        return args, kwargs

    CASES[name] = Case(name, cls_path, build, inputs, note, None, streams)


_MOE = ("a mixture of experts (each token routed by its own row): the experts module run whole on each chunk's rows "
        "as one op")
_SW = f"sliding window of {WINDOW} tokens: the banded [N, N] mask given, its query rows taken per chunk"

_add("llama", "llama", "LlamaDecoderLayer")
_add("mistral", "mistral", "MistralDecoderLayer", overrides=dict(sliding_window=None))
_add("mistral_sliding", "mistral", "MistralDecoderLayer", overrides=dict(sliding_window=WINDOW), note=_SW)
_add("ministral", "ministral", "MinistralDecoderLayer", overrides=dict(sliding_window=None,
                                                                        layer_types=["full_attention"] * 2))
_add("qwen2", "qwen2", "Qwen2DecoderLayer")
_add("qwen3", "qwen3", "Qwen3DecoderLayer")
_add("gemma", "gemma", "GemmaDecoderLayer")
_add("gemma2", "gemma2", "Gemma2DecoderLayer", layer=1,
     overrides=dict(sliding_window=WINDOW, attn_implementation="eager"),
     note="transformers 5.24 refuses SDPA for Gemma 2 (attention logit soft-capping): its eager attention, written "
          "as matmul + tanh soft-cap + softmax, found as one attention in the graph")
_add("gemma3_text", "gemma3", "Gemma3DecoderLayer", model_type="gemma3_text",
     overrides=dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), layer=1,
     note="a full-attention layer")
_add("gemma3_text_sliding", "gemma3", "Gemma3DecoderLayer", model_type="gemma3_text",
     overrides=dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), layer=0, note=_SW)
_add("phi", "phi", "PhiDecoderLayer")
_add("phi3", "phi3", "Phi3DecoderLayer", overrides=dict(sliding_window=None))
_add("granite", "granite", "GraniteDecoderLayer")
_add("olmo", "olmo", "OlmoDecoderLayer")
_add("olmo2", "olmo2", "Olmo2DecoderLayer")
_add("olmo3", "olmo3", "Olmo3DecoderLayer", layer=1,
     overrides=dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
     note="a full-attention layer")
_add("cohere", "cohere", "CohereDecoderLayer")
_add("cohere2", "cohere2", "Cohere2DecoderLayer", layer=1,
     overrides=dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
     note="a full-attention layer (no rotary on those)")
_add("stablelm", "stablelm", "StableLmDecoderLayer")
_add("gpt_neox", "gpt_neox", "GPTNeoXLayer")
_add("falcon", "falcon", "FalconDecoderLayer", overrides=dict(new_decoder_architecture=True, num_kv_heads=2,
                                                              head_dim=None),
     note="FalconModel hands its layers a materialised [N, N] causal mask even for SDPA without padding (each Q "
          "chunk takes its rows of it); K and V picked out of the fused projection by constant indices")
_add("starcoder2", "starcoder2", "Starcoder2DecoderLayer", overrides=dict(sliding_window=None))
_add("glm", "glm", "GlmDecoderLayer")
_add("glm4", "glm4", "Glm4DecoderLayer")
_add("helium", "helium", "HeliumDecoderLayer")
_add("smollm3", "smollm3", "SmolLM3DecoderLayer")
_add("arcee", "arcee", "ArceeDecoderLayer")
_add("apertus", "apertus", "ApertusDecoderLayer")
_add("seed_oss", "seed_oss", "SeedOssDecoderLayer")
_add("hunyuan_v1_dense", "hunyuan_v1_dense", "HunYuanDenseV1DecoderLayer")
_add("exaone4", "exaone4", "Exaone4DecoderLayer", overrides=dict(sliding_window=None))
_add("ernie4_5", "ernie4_5", "Ernie4_5DecoderLayer")
_add("nemotron", "nemotron", "NemotronDecoderLayer")
_add("persimmon", "persimmon", "PersimmonDecoderLayer")
_add("gpt2", "gpt2", "GPT2Block")
_add("gptj", "gptj", "GPTJBlock", overrides=dict(rotary_dim=8))
_add("bloom", "bloom", "BloomBlock", overrides=dict(attn_implementation="eager"), streams=False,
     note="no SDPA in transformers 5.24 (ALiBi): eager attention, a [N, N] bias over rows x rows")
_add("opt", "opt", "OPTDecoderLayer", overrides=dict(ffn_dim=128, word_embed_proj_dim=64))
_add("mpt", "mpt", "MptBlock", overrides=dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2,
                                             attn_implementation="eager"), streams=False,
     note="no SDPA in transformers 5.24 (ALiBi): eager attention, a [N, N] bias over rows x rows")
_add("mixtral", "mixtral", "MixtralDecoderLayer", note=_MOE,
     overrides=dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2))
_add("qwen2_moe", "qwen2_moe", "Qwen2MoeDecoderLayer", note=_MOE,
     overrides=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64))
_add("qwen3_moe", "qwen3_moe", "Qwen3MoeDecoderLayer", note=_MOE,
     overrides=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
_add("gpt_oss", "gpt_oss", "GptOssDecoderLayer", layer=1,
     overrides=dict(attn_implementation="eager", num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
     note="attention sinks (eager attention: a per-head logit joined to the scores, merged with each Q chunk's "
          "attention by log-sum-exp) and a mixture of experts whose forward returns its router scores too (run whole "
          "on each chunk's rows, both outputs)")
_add("deepseek_v3", "deepseek_v3", "DeepseekV3DecoderLayer", streams=True,
     overrides=dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    head_dim=8),
     note="a dense (first_k_dense_replace) layer with multi-head latent attention")
_add("granitemoe", "granitemoe", "GraniteMoeDecoderLayer", note=_MOE,
     overrides=dict(num_local_experts=4, num_experts_per_tok=2))
_add("phimoe", "phimoe", "PhimoeDecoderLayer", note=_MOE,
     overrides=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None))
_add("gpt_bigcode", "gpt_bigcode", "GPTBigCodeBlock", overrides=dict(multi_query=True),
     note="multi-query attention (one K/V head)")
_add("codegen", "codegen", "CodeGenBlock", overrides=dict(rotary_dim=8, n_ctx=8192))
_add("deepseek_v2", "deepseek_v2", "DeepseekV2DecoderLayer",
     overrides=dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    head_dim=8),
     note="a dense (first_k_dense_replace) layer with multi-head latent attention")
_add("llama4_text", "llama4", "Llama4TextDecoderLayer", model_type="llama4_text",
     overrides=dict(intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, moe_layers=[],
                    no_rope_layers=[1, 1], attention_chunk_size=8192),
     note="a dense layer (moe_layers=[]) with rotary, attention chunk longer than the rows")
_add("jamba_attention", "jamba", "JambaAttentionDecoderLayer",
     overrides=dict(num_experts=1, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False), layer=1,
     note="an attention layer with a dense MLP (num_experts=1)")
_add("lfm2_attention", "lfm2", "Lfm2DecoderLayer", layer=1, overrides=dict(layer_types=["conv", "full_attention"]),
     note="a full-attention layer")
_add("lfm2_conv", "lfm2", "Lfm2DecoderLayer", layer=0,
     overrides=dict(layer_types=["conv", "full_attention"]),
     note="a short-convolution layer: a causal convolution over the rows (each chunk reads its kernel's reach of "
          "rows before it)")
_add("qwen3_next", "qwen3_next", "Qwen3NextDecoderLayer", layer=1,
     overrides=dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=64),
     note="a full-attention layer with a mixture of experts (run whole on each chunk's rows)")
_add("minimax", "minimax", "MiniMaxDecoderLayer", layer=1, note=_MOE,
     overrides=dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None))
_add("dbrx", "dbrx", "DbrxBlock", note=_MOE,
     overrides=dict(d_model=64, n_heads=4, n_layers=2, ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4,
                                                                      moe_top_k=2),
                    attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)))
_add("jamba_mamba", "jamba", "JambaMambaDecoderLayer", layer=0, streams=False,
     overrides=dict(num_experts=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16),
     note="a Mamba layer (its PyTorch path without mamba-ssm): a causal convolution over the rows and a selective "
          "scan written as a Python loop over every row")
_add("falcon_h1", "falcon_h1", "FalconH1DecoderLayer", streams=False,
     overrides=dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16, mamba_chunk_size=64),
     note="attention and a Mamba-2 mixer side by side (its PyTorch path without mamba-ssm): a causal convolution "
          "over the rows and a scan over chunks of mamba_chunk_size rows (the rows padded to a whole chunk)")


# -- Llama 4's vision encoder: its rows are one image's patches and the CLS token -------------------------------------
_VISION_PATCH = 8


def _llama4_vision(side: int) -> tuple[nn.Module, nn.ModuleList]:
    """Llama4VisionModel for a ``side`` x ``side`` patch grid (its rotary table is sized by the image), built once."""
    name = f"llama4_vision@{side}"
    if name not in _MODELS:
        from transformers import Llama4VisionConfig
        from transformers.models.llama4.modeling_llama4 import Llama4VisionModel
        cfg = Llama4VisionConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                                 image_size=side * _VISION_PATCH, patch_size=_VISION_PATCH, vision_output_dim=64,
                                 projector_input_dim=64, projector_output_dim=64)
        state = torch.random.get_rng_state()
        torch.manual_seed(1234)
        try:
            model = Llama4VisionModel(cfg).eval()
        finally:
            torch.random.set_rng_state(state)
        _MODELS[name] = (model, _layers(model))
    return _MODELS[name]


def _llama4_vision_side(n: int) -> int:
    """The largest even patch grid (the pixel-shuffle adapter halves it) whose patches and CLS token fit in n rows."""
    side = int((n - 1) ** 0.5)
    return side - side % 2


def _llama4_vision_inputs(n: int, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict]:
    side = _llama4_vision_side(n)
    model, layers = _llama4_vision(side)
    gen = torch.Generator().manual_seed(n)
    pixels = torch.randn(1, 3, side * _VISION_PATCH, side * _VISION_PATCH, generator=gen)
    args, kwargs = _move(_record_call(model, layers[0], dict(pixel_values=pixels)), device, dtype)
    kwargs["hidden_state"] = torch.randn(1, side * side + 1, 64, device=device, dtype=dtype)
    return args, kwargs


CASES["llama4_vision"] = Case(
    "llama4_vision", "transformers.models.llama4.modeling_llama4:Llama4VisionEncoderLayer",
    lambda: _fresh("llama4_vision", _llama4_vision(4)[1][0], "Llama4VisionEncoderLayer"), _llama4_vision_inputs,
    "the vision encoder's layer: its rows are an image's patches and the CLS token, side x side + 1 <= n of them "
    "(the model's rotary table fixes the grid); 2-D complex rotary, attention_mask=None", None, True)
