"""Modules streamplan leaves stock whose activations still grow with the sequence (output heads, embeddings, patch
convolutions). They are estimated at each call, so that the report shows them and a byte budget they would break
fails before they run, instead of the model silently peaking above what the plans promised."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

WATCHED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
MATTERS_FRACTION = 16   # listed in the report when its output reaches 1/16 of the largest streamed peak
MATTERS_MIN = 2**20     # ... or 1 MiB where nothing streamed was planned


@dataclass(eq=False)
class StockWatch:
    """One stock module under watch: the largest output it produced and the call that produced it."""

    name: str
    module: nn.Module
    previous: Any                 # what module.__dict__["forward"] held before, or the missing marker
    wrapper: Callable | None = None
    largest: int = 0              # bytes of its largest output so far
    live: int = 0                 # bytes of that call's inputs
    shape: tuple | None = None    # that call's input shape

    def record(self, estimate: int, live: int, shape: tuple) -> None:
        if estimate > self.largest:
            self.largest, self.live, self.shape = estimate, live, shape

    @property
    def total(self) -> int:
        return self.largest + self.live


def activation_bytes(module: nn.Module, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the output this call of a watched module allocates (None when its input is not a tensor)."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor):
        return None
    if isinstance(module, nn.Linear):
        return x.numel() // max(1, x.shape[-1]) * module.out_features * x.element_size()
    if isinstance(module, nn.Embedding):
        return x.numel() * module.embedding_dim * module.weight.element_size()
    spatial = x.shape[-(x.dim() - 2):] if x.dim() > 2 else x.shape[-1:]
    out = 1
    for size, stride in zip(spatial, module.stride):
        out *= math.ceil(size / stride)
    batch = x.shape[0] if x.dim() == len(spatial) + 2 else 1
    return batch * module.out_channels * out * x.element_size()


def watch_candidates(root: nn.Module, covered: list[str]) -> list[tuple[str, nn.Module]]:
    """Stock leaf modules whose output scales with the input rows, outside every streamed or reported module, and
    untouched (no patched forward, no hooks: those are someone else's)."""
    def inside(name: str) -> bool:
        return any(c == "" or name == c or name.startswith(c + ".") for c in covered)

    found = []
    for name, m in root.named_modules():
        if not name or not isinstance(m, WATCHED) or inside(name) or "forward" in m.__dict__:
            continue
        if m._forward_hooks or m._forward_pre_hooks:
            continue
        found.append((name, m))
    return found


def matters(watch: StockWatch, largest_streamed: int) -> bool:
    threshold = largest_streamed / MATTERS_FRACTION if largest_streamed else MATTERS_MIN
    return watch.largest > 0 and watch.largest >= threshold
