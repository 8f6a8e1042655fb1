"""Stock against streamed on the same input: the differences per output, with the caller's state untouched."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .api import apply, bypass
from .execute.compare import compare_outputs, private_copy
from .specs import STREAMED_MARK

__all__ = ["verify", "compare_outputs"]


def verify(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, dict[str, float]]:
    """Run ``model`` streamed and stock on the same input; returns ``{output: {"max_abs", "rel", "nan_mismatch"}}``.

    Both runs get private copies of the inputs (caches included), so the caller's tensors and caches are as they were.
    If streamplan is not applied to ``model``, it is applied for this call (fixed default chunks, so that inputs
    longer than a chunk do stream) and removed after.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    streamed_already = any(getattr(m.__dict__.get("forward"), STREAMED_MARK, False) for m in model.modules())
    handle = None if streamed_already else apply(model, budget=None)
    try:
        with torch.inference_mode():
            out = model(*private_copy(args), **private_copy(kwargs))
            with bypass():
                ref = model(*private_copy(args), **private_copy(kwargs))
    finally:
        if handle is not None:
            handle.remove()
    return compare_outputs(out, ref)
