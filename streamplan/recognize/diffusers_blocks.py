"""What the hand-written diffusers block binders share (the blocks themselves live in their family's file).

Each binder takes one call apart into per-stream prefix (norm, modulation) and suffix (gate, residual, and the
row-local rest: cross-attention to text, the MLP), calling the block's own submodules on row chunks.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ir import AttentionSpec, MLPSpec, Skip
from .diffusers_mlp import recognize_feedforward


def _children(name: str, module: nn.Module, attn_names: list[str], mlp_names: list[str], recognize_attn):
    """The block's attention and MLP specs, or the reason the block cannot be streamed whole."""
    attns, mlps = [], []
    for n in attn_names:
        spec = recognize_attn(f"{name}.{n}", getattr(module, n))
        if not isinstance(spec, AttentionSpec):
            return f"{n}: {spec.reason if isinstance(spec, Skip) else 'not recognised'}"
        attns.append(spec)
    for n in mlp_names:
        spec = recognize_feedforward(f"{name}.{n}", getattr(module, n))
        if not isinstance(spec, MLPSpec):
            return f"{n}: {spec.reason if isinstance(spec, Skip) else 'not recognised'}"
        mlps.append(spec)
    return attns, mlps


def _row_norm(norm: nn.Module) -> bool:
    known = ("FP32LayerNorm", "LayerNorm", "Identity", "RMSNorm")
    return type(norm).__name__ in known and "forward" not in norm.__dict__


def _fp16_clip(t: torch.Tensor) -> torch.Tensor:
    return t.clip(-65504, 65504) if t.dtype == torch.float16 else t


