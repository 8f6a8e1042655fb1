"""Stock against streamed on the same input: the differences per output, with the caller's state untouched."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .api import apply, bypass
from .execute.compare import NotCopyable, compare_outputs, private_copy
from .specs import STREAMED_MARK

__all__ = ["verify", "compare_outputs"]

log = logging.getLogger("streamplan")


def verify(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, dict[str, float]]:
    """Run ``model`` streamed and stock on the same input; returns ``{output: {"max_abs", "rel", "nan_mismatch"}}``.

    Both runs get private copies of the inputs (caches included), so the caller's tensors and caches are as they were;
    a cache that cannot be copied (transformers' offloading cache) is refused before either run (``ValueError``).
    If streamplan is not applied to ``model``, it is applied for this call (fixed default chunks, so that inputs
    longer than a chunk do stream) and removed after.

    Memory: this is a check, not a streamed run. Its stock run peaks at stock's peak, with a copy of the inputs and
    the streamed run's outputs held beside it; what that came to is logged and, where ``model`` is streamed by a
    handle, noted in that handle's report.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        private_copy(args), private_copy(kwargs)   # refused here, before anything is applied or run
    except NotCopyable as e:
        raise NotCopyable(f"verify: {e}; pass a cache that can be copied (a plain DynamicCache) or none") from e
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
    _say_extra(model, handle, args, kwargs, out)
    return compare_outputs(out, ref)


def _say_extra(model: nn.Module, temporary: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """What verify's stock run held beyond a streamed call: logged, and noted on the handle streaming ``model``."""
    from .api import live_handle
    from .execute.call_state import live_bytes
    from .execute.compare import output_tensors
    from .plan.budget import fmt_bytes
    inputs = live_bytes(args, kwargs)
    held = sum(t.numel() * t.element_size() for t in output_tensors(out).values())
    handle = temporary or live_handle(model)
    plans = [p for ps in handle.plans.values() for p in ps] if handle is not None else []
    stock = max((p.live_bytes + p.stock_peak for p in plans if p.stock_peak), default=0)
    text = ("verify ran stock after the streamed call: its extra memory is stock's peak"
            + (f" (est. {fmt_bytes(stock)} with its inputs)" if stock else "")
            + f", with a copy of the inputs ({fmt_bytes(inputs)}) and the streamed outputs ({fmt_bytes(held)}) "
              "held beside it")
    log.info("streamplan: %s", text)
    if temporary is None and handle is not None:   # the latest verify's, one line
        handle.checks[:] = [c for c in handle.checks if not c.startswith("verify ")] + [text]
