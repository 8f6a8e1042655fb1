"""transformers' Llama family (Llama, Mistral, Qwen2/3, ... where the forward is Llama's), everything streamplan
knows by hand about it in one place: the attention (q/k/v/o projections, GQA, rotary from ``position_embeddings``,
causal, under ``sdpa`` and ``eager``, padded-batch masks, prefill into an empty cache) and the gated MLP. Decoder
layers stream whole from their captured graph; these parts serve the calls a graph cannot take (a cache)."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...specs import AttentionCall, AttentionSpec, MLPSpec, Segment, Skip
from ...recognize.checks import call_args, elementwise, same_code, stock_problem


def _reference_forward():
    from transformers.models.llama.modeling_llama import LlamaMLP
    return LlamaMLP.forward


def recognize_gated_mlp(name: str, module: nn.Module) -> MLPSpec | Skip | None:
    if "transformers" not in sys.modules:
        return None
    if not all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    ref = _reference_forward()
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if not same_code(type(module).forward, ref):
        return skip("gate/up/down MLP whose forward is not the Llama-family forward")
    problem = stock_problem(module)
    if problem:
        return skip(problem)
    act = elementwise(module.act_fn)
    if act is None:
        return skip(f"activation {type(module.act_fn).__name__} is not known to be elementwise")
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    if not (gate.out_features == up.out_features == down.in_features):
        return skip("projection widths do not line up")
    return MLPSpec(module=module, label=f"transformers.{type(module).__name__}[gated {type(act).__name__}]",
                   layout="gated-separate", in_proj=up, out_proj=down, act=act, ffn=up.out_features, gate_proj=gate)


# keyword arguments the Llama decoder layer passes that do not change the attention math under sdpa/eager
_HARMLESS = {"position_ids", "cache_position", "use_cache"}
CACHE_ALIAS = {"past_key_values": "cache"}   # the name transformers used before 5.x renamed it


def _reference():
    from transformers.models.llama.modeling_llama import LlamaAttention
    return LlamaAttention.forward


def _bind_llama(attn, args: tuple, kwargs: dict) -> AttentionCall | str:
    names = ("hidden_states", "position_embeddings", "attention_mask", "cache")
    call = call_args(names, args, kwargs, aliases=CACHE_ALIAS, extra=True)
    if isinstance(call, str):
        return call
    extra = {k for k in call if k not in names and k not in _HARMLESS}
    if call.get("output_attentions"):
        return "output_attentions asks for the attention weights"
    extra.discard("output_attentions")
    if extra:
        return f"arguments streamplan does not know: {sorted(extra)}"
    x, pe, mask, cache = (call.get(k) for k in names)
    impl = attn.config._attn_implementation or "eager"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    if pe is None:
        return "no position_embeddings"
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 4):
        return f"attention_mask of type {type(mask).__name__} is not a 4-D tensor"
    B, N, _ = x.shape
    D = attn.head_dim
    H = attn.q_proj.out_features // D
    Hkv = attn.k_proj.out_features // D
    cache_update = None
    if cache is not None:
        if type(cache).__name__ != "DynamicCache" or cache.get_seq_length(attn.layer_idx) != 0:
            return "a cache that already holds tokens (streamplan streams prefill from an empty dynamic cache)"
        cache_kwargs = {k: call[k] for k in _HARMLESS if k in call}
        cache_update = lambda k, v: cache.update(k, v, attn.layer_idx, kwargs=cache_kwargs)  # noqa: E731
    if mask is not None and mask.shape[-1] != N:
        return "attention_mask spans more keys than this call's tokens"
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    cos, sin = pe

    def rotate(t, a, b):  # t [B, rows, heads, D] -> same, rotated with the rows' own positions
        t = t.transpose(1, 2)
        c, s = cos[:, a:b] if cos.shape[1] != 1 else cos, sin[:, a:b] if sin.shape[1] != 1 else sin
        # the model's own function rotates a pair (q, k): the second is one head of t, nearly free, and discarded
        return rope(t, t[:, :1], c, s)[0].transpose(1, 2)

    def q(h, a, b):
        return rotate(attn.q_proj(h).view(B, b - a, H, D), a, b)

    def kv(h, a, b):
        return rotate(attn.k_proj(h).view(B, b - a, Hkv, D), a, b), attn.v_proj(h).view(B, b - a, Hkv, D)

    def out(o, a, b):
        return attn.o_proj(o.reshape(B, b - a, H * D))

    # transformers' convention: a backend given no mask attends causally (eager alone applies only the mask it gets)
    causal = impl != "eager" and N > 1 and mask is None and getattr(attn, "is_causal", True)
    return AttentionCall(batch=B, heads=H, kv_heads=Hkv, head_dim=D, segments=[Segment(x, q, kv, out)],
                         finish=lambda outs: (outs[0], None), dtype=x.dtype, causal=causal, scale=attn.scaling,
                         mask=mask, cache_update=cache_update)


def recognize_llama_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    if "transformers" not in sys.modules:
        return None
    if not all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "config", "head_dim")):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if not same_code(type(module).forward, _reference()):
        return skip("q/k/v/o attention whose forward is not the Llama-family forward")
    problem = stock_problem(module)
    if problem:
        return skip(problem)
    if getattr(module.config, "sliding_window", None) and getattr(module, "sliding_window", None):
        return skip("sliding-window attention is not handled")
    if not hasattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb"):
        return skip("its module has no apply_rotary_pos_emb")
    D = module.head_dim
    return AttentionSpec(module=module, label=f"transformers.{type(module).__name__}",
                         heads=module.q_proj.out_features // D,
                         kv_heads=module.k_proj.out_features // D, head_dim=D, dim_out=module.o_proj.out_features,
                         bind=lambda args, kwargs: _bind_llama(module, args, kwargs),
                         backend=lambda: module.config._attn_implementation or "eager")


