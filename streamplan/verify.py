"""Stock against streamed on the same input: the differences per output."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _tensors(out: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    found: dict[str, torch.Tensor] = {}
    if isinstance(out, dict):  # includes transformers' ModelOutput
        for k, v in out.items():
            found.update(_tensors(v, f"{prefix}.{k}"))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            found.update(_tensors(v, f"{prefix}[{i}]"))
    elif hasattr(out, "to_tuple"):
        found.update(_tensors(out.to_tuple(), prefix))
    return found


def compare_outputs(streamed: Any, stock: Any) -> dict[str, dict[str, float]]:
    """Per output tensor: max absolute difference and that relative to stock's largest magnitude."""
    a, b = _tensors(streamed), _tensors(stock)
    result = {}
    for name, ref in b.items():
        out = a.get(name)
        if out is None or out.shape != ref.shape:
            result[name] = {"max_abs": float("inf"), "rel": float("inf")}
            continue
        diff = (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
        scale = ref.float().abs().max().item() if ref.numel() else 0.0
        result[name] = {"max_abs": diff, "rel": diff / scale if scale else diff}
    return result


def verify(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, dict[str, float]]:
    """Run ``model`` streamed and stock on the same input; returns ``{output: {"max_abs", "rel"}}``.

    If streamplan is not applied to ``model``, it is applied for this call (fixed default chunks, so that inputs
    longer than a chunk do stream) and removed after.
    """
    from .api import apply, bypass
    from .recognize.checks import STREAMED_MARK

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    streamed_already = any(getattr(m.__dict__.get("forward"), STREAMED_MARK, False) for m in model.modules())
    handle = None if streamed_already else apply(model, budget=None)
    try:
        with torch.inference_mode():
            out = model(*args, **kwargs)
            with bypass():
                ref = model(*args, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    return compare_outputs(out, ref)
