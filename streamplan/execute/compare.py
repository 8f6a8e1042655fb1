"""Comparing a streamed call's outputs with stock's, NaN-aware, and private copies of a call's inputs (caches
included) so a reference run leaves the caller's state as it was: what ``verify``, ``self_check`` and the K/V error of
an approximate store share."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..registries import state_tensors


def output_tensors(out: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    found: dict[str, torch.Tensor] = {}
    if isinstance(out, dict):  # includes transformers' ModelOutput
        for k, v in out.items():
            found.update(output_tensors(v, f"{prefix}.{k}"))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            found.update(output_tensors(v, f"{prefix}[{i}]"))
    elif hasattr(out, "to_tuple"):
        found.update(output_tensors(out.to_tuple(), prefix))
    return found


class NotCopyable(ValueError):
    """A call's state object (a cache) that a stock reference run needs a private copy of, and that cannot be copied
    (a cache that holds CUDA streams)."""


def private_copy(value: Any) -> Any:
    """A copy of a call's inputs that a reference run may change freely: tensors cloned, registered state objects
    (``registries.state_tensors``: a host library's caches) deep-copied, containers rebuilt; other objects shared.
    ``NotCopyable`` where a state object cannot be copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a namedtuple
        return type(value)(*(private_copy(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(private_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: private_copy(v) for k, v in value.items()}
    if state_tensors(value) is not None:
        try:
            return copy.deepcopy(value)
        except Exception as e:   # what deepcopy raises for an object it cannot copy varies (TypeError, RuntimeError)
            raise NotCopyable(f"the call's {type(value).__name__} cannot be copied for a stock reference run "
                              f"({type(e).__name__}: {e})") from e
    return value


def compare_outputs(streamed: Any, stock: Any) -> dict[str, dict[str, float]]:
    """Per output tensor: max absolute difference and that relative to stock's largest finite magnitude.

    NaN-aware: a NaN where stock has a NaN counts as equal (as do equal infinities); NaNs in one output only are
    counted in ``nan_mismatch`` and make ``rel`` infinite, so a check cannot pass over them."""
    a, b = output_tensors(streamed), output_tensors(stock)
    result = {}
    for name, ref in b.items():
        out = a.get(name)
        if out is None or out.shape != ref.shape:
            result[name] = {"max_abs": float("inf"), "rel": float("inf"), "nan_mismatch": 0}
            continue
        if not ref.numel():
            result[name] = {"max_abs": 0.0, "rel": 0.0, "nan_mismatch": 0}
            continue
        o, r = out.float(), ref.float()
        o_nan, r_nan = o.isnan(), r.isnan()
        mismatch = int((o_nan != r_nan).sum().item())
        same = (o == r) | (o_nan & r_nan)
        diff = torch.where(same | o_nan | r_nan, torch.zeros_like(o), (o - r).abs())
        max_abs = diff.max().item()
        finite = r[r.isfinite()]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        rel = max_abs / scale if scale else max_abs
        result[name] = {"max_abs": max_abs, "rel": float("inf") if mismatch else rel, "nan_mismatch": mismatch}
    return result
