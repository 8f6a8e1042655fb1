"""Donated inputs: a model forward that keeps no other reference to a block's input lets the block overwrite it with
its output, so no second whole-sequence residual exists."""
from __future__ import annotations

import contextlib
import threading

import torch


class _Donated(threading.local):
    tensors: tuple = ()


_DONATED = _Donated()


@contextlib.contextmanager
def donate(*tensors: torch.Tensor):
    """Within this context a streamed block may update these inputs in place (a model forward that rebinds its
    hidden states to each block's output, and keeps no other reference, says so)."""
    previous, _DONATED.tensors = _DONATED.tensors, tensors
    try:
        yield
    finally:
        _DONATED.tensors = previous


def donated(x: torch.Tensor) -> bool:
    """Whether ``x`` was donated (itself, or as the host tensor of donated ``HostRows``)."""
    return any(x is t or x is getattr(t, "tensor", None) for t in _DONATED.tensors)
