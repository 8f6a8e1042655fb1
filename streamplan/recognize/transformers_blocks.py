"""transformers' Llama-family decoder layer streamed whole: input norm, attention, residual, norm, MLP, residual."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..executors.mlp import MLPRunner
from ..ir import AttentionSpec, BlockCall, BlockSpec, MLPSpec, Skip, Stream
from .checks import call_args, same_code, stock_problem
from .transformers_attention import CACHE_ALIAS, _bind_llama, recognize_llama_attention
from .transformers_mlp import recognize_gated_mlp

_NAMES = ("hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings")


def _bind_layer(layer, mlp: MLPRunner, args: tuple, kwargs: dict) -> BlockCall | str:
    call = call_args(_NAMES, args, kwargs, aliases=CACHE_ALIAS, extra=True)
    if isinstance(call, str):
        return call
    x = call.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    att = _bind_llama(layer.self_attn, (), call)
    if isinstance(att, str):
        return att

    def suffix(r, h, y, a, b):
        r = r + y
        return r + mlp(layer.post_attention_layernorm(r))

    return BlockCall([Stream(x, lambda r, a, b: layer.input_layernorm(r), suffix)], att, finish=lambda xs: xs[0])


def _rms_norm_ok(norm: nn.Module) -> bool:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return same_code(type(norm).forward, LlamaRMSNorm.forward) and "forward" not in norm.__dict__


def recognize_llama_layer(name: str, module: nn.Module) -> BlockSpec | Skip | None:
    if "transformers" not in sys.modules:
        return None
    if not all(hasattr(module, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
        return None
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if not same_code(type(module).forward, LlamaDecoderLayer.forward):
        return skip("decoder layer whose forward is not the Llama-family forward (its attention and MLP are "
                    "considered on their own)")
    problem = stock_problem(module)
    if problem:
        return skip(problem)
    if not (_rms_norm_ok(module.input_layernorm) and _rms_norm_ok(module.post_attention_layernorm)):
        return skip("a norm streamplan does not know")
    attn = recognize_llama_attention(f"{name}.self_attn", module.self_attn)
    mlp = recognize_gated_mlp(f"{name}.mlp", module.mlp)
    if not isinstance(attn, AttentionSpec) or not isinstance(mlp, MLPSpec):
        bad = attn if not isinstance(attn, AttentionSpec) else mlp
        return skip(f"{bad.reason if isinstance(bad, Skip) else 'a child is not recognised'}")
    runner = MLPRunner(mlp)
    return BlockSpec(module, f"transformers.{type(module).__name__}", attn, [mlp],
                     bind=lambda args, kwargs: _bind_layer(module, runner, args, kwargs))
