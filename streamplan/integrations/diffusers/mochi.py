"""diffusers joint attention that keeps only the valid text tokens (``MochiAttention`` with
``MochiAttnProcessor2_0``), streamed as an attention part.

Its processor picks each batch element's valid text tokens with ``nonzero`` (a length read off the data), joins them
after the video rows and attends [video rows + valid text] as one sequence; the invalid text positions come back as
zero rows through the text output projection. A captured block cannot take a length read off the data, so the module is
taken apart here, per call: the valid text positions are picked once (the same indices the processor picks), and the
joint sequence is two segments, the video rows (streamed: Q, K, V by the module's own layers, QK norms, rotary on these
rows alone) and the valid text rows (few: their K/V built with the video rows' in phase KV, their queries attended once;
their projections run over every text position and the valid rows are picked after, as the processor does). The text
output is then laid out as the processor lays it out (it pads each element's joint output at its end: the valid text
rows first, in order, then zeros) and goes through ``to_add_out`` over every text position. Batch elements whose valid
lengths differ stay stock, named. Follows diffusers 0.42.1's processor, checked by the source fingerprints below.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .followed import followed_spec, processor_call, unfollowed
from ...specs import AttentionCall, AttentionSpec, Segment, Skip

_MODULE = "diffusers.models.attention_processor"
_NORMS = "diffusers.models.normalization"
# source fingerprints (checks.source_fingerprint) of what the binder follows, as in diffusers 0.42.1 (the processor's
# rotary is a function inside its __call__, so the processor's fingerprint covers it)
FOLLOWED = {"MochiAttnProcessor2_0.__call__": "2adfa8d057749ebc", "MochiAttention.forward": "affb1fe2c4308500",
            "MochiRMSNorm.forward": "162ce444d497cfc4"}
_ARGS = ("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb")


def _sources(mod, norms) -> dict:
    """The sources the binder follows, by the names ``FOLLOWED`` records them under."""
    return {"MochiAttnProcessor2_0.__call__": mod.MochiAttnProcessor2_0.__call__,
             "MochiAttention.forward": mod.MochiAttention.forward, "MochiRMSNorm.forward": norms.MochiRMSNorm.forward}


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The processor's ``apply_rotary_emb`` on rows of x [B, c, H, D] with their rows of the tables [c, H, D/2]."""
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    cos_part = (x_even * cos - x_odd * sin).to(x.dtype)
    sin_part = (x_even * sin + x_odd * cos).to(x.dtype)
    return torch.stack([cos_part, sin_part], dim=-1).flatten(-2)


def _valid_tokens(mask, batch: int, tokens: int) -> list[torch.Tensor] | str:
    """Each batch element's valid text positions as the processor picks them (``nonzero`` of its flattened mask row),
    or why they cannot be laid out as one segment."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[0] != batch:
        return "attention_mask is not a [batch, text tokens] tensor"
    if mask[0].numel() != tokens:
        return f"attention_mask has {mask[0].numel()} positions per batch element for {tokens} text tokens"
    picked = [torch.nonzero(mask[i][None, :].flatten(), as_tuple=False).flatten() for i in range(batch)]
    lengths = sorted({len(p) for p in picked})
    if len(lengths) > 1:
        return f"valid text lengths differ between batch elements ({lengths}): one joint sequence cannot hold them"
    return picked


def _bind_mochi(attn, args: tuple, kwargs: dict) -> AttentionCall | str:
    call = processor_call(_ARGS, attn.processor, args, kwargs)
    if isinstance(call, str):
        return call
    x, enc = call.get("hidden_states"), call.get("encoder_hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    if not isinstance(enc, torch.Tensor) or enc.dim() != 3 or enc.shape[0] != x.shape[0]:
        return "encoder_hidden_states is not [batch, text tokens, dim]"
    B, N, _ = x.shape
    S = enc.shape[1]
    picked = _valid_tokens(call.get("attention_mask"), B, S)
    if isinstance(picked, str):
        return picked
    rope = call.get("image_rotary_emb")
    H = attn.heads
    D = attn.to_q.out_features // H
    if rope is not None:
        if not (isinstance(rope, (tuple, list)) and len(rope) == 2 and all(
                isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == N for t in rope)):
            return "image_rotary_emb is not a (cos, sin) pair of [rows, heads, head_dim / 2] tables"
    valid = len(picked[0])
    text = torch.stack([enc[i, p] for i, p in enumerate(picked)]) if valid else None   # [B, valid, dim]

    def unflat(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(2, (H, -1))

    def q(h, a, b):
        query = attn.norm_q(unflat(attn.to_q(h)))
        return query if rope is None else _rotary(query, rope[0][a:b], rope[1][a:b])

    def kv(h, a, b):
        key = attn.norm_k(unflat(attn.to_k(h)))
        if rope is not None:
            key = _rotary(key, rope[0][a:b], rope[1][a:b])
        return key, unflat(attn.to_v(h))

    def out(o, a, b):
        return attn.to_out[1](attn.to_out[0](o.flatten(2, 3)))

    # the text projections run as the processor runs them, over every text position, and the valid rows [a, b) are
    # picked after (a projection over fewer rows may take another kernel: not the same bits)
    def pick(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return torch.stack([t[i, p[a:b]] for i, p in enumerate(picked)])

    def text_q(h, a, b):
        return pick(attn.norm_added_q(unflat(attn.add_q_proj(enc))), a, b)

    def text_kv(h, a, b):
        key = attn.norm_added_k(unflat(attn.add_k_proj(enc)))
        return pick(key, a, b), pick(unflat(attn.add_v_proj(enc)), a, b)

    def text_rows(o, a, b):   # the attention's own rows: the projection runs over every text position in finish
        return o.flatten(2, 3)

    segments = [Segment(x, q, kv, out)]
    if text is not None:
        segments.append(Segment(text, text_q, text_kv, text_rows))

    def finish(outs: list[torch.Tensor]):
        """The processor's text output: its joint output padded at the end, so the valid text rows first, in order,
        then zeros; projected over every text position."""
        video = outs[0]
        rows = video.new_zeros((B, S, H * D))
        if text is not None:
            rows[:, :valid] = outs[1]
        context = attn.to_add_out(rows) if hasattr(attn, "to_add_out") else rows
        return video, context

    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=segments, finish=finish, dtype=x.dtype)


def _heads_ok(module: nn.Module, norm_cls) -> str | None:
    heads, inner = module.heads, module.to_q.out_features
    if inner % heads:
        return f"its {inner} Q features are not whole heads of {heads}"
    D = inner // heads
    for name in ("to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        if getattr(module, name).out_features != inner:
            return f"{name} is not {inner} features wide"
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(module, name)
        if type(norm) is not norm_cls or tuple(norm.dim) != (D,):
            return f"{name} is not a MochiRMSNorm over head_dim"
    if len(module.to_out) != 2 or not isinstance(module.to_out[1], nn.Dropout):
        return "to_out is not [linear, dropout]"
    return None


def recognize_mochi_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    """Mochi's joint attention (``MochiAttention`` with its ``MochiAttnProcessor2_0``); None for anything else."""
    mod, norms = sys.modules.get(_MODULE), sys.modules.get(_NORMS)
    if mod is None or norms is None or type(module) is not getattr(mod, "MochiAttention", None):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if type(getattr(module, "processor", None)) is not mod.MochiAttnProcessor2_0:
        return skip(f"its processor is {type(getattr(module, 'processor', None)).__name__}, not the "
                    "MochiAttnProcessor2_0 streamplan follows")
    problem = unfollowed(module, mod.MochiAttention.forward, _sources(mod, norms), FOLLOWED)
    if problem:
        return skip(problem)
    problem = _heads_ok(module, norms.MochiRMSNorm)
    if problem:
        return skip(problem)
    return followed_spec(module, "diffusers MochiAttention[valid text tokens joined]", module.heads,
                         module.to_q.out_features, module.to_out[0],
                         lambda args, kwargs: _bind_mochi(module, args, kwargs), "native")
