"""What an op in a captured graph is, by torch's own names and tags (shared by the analysis and what runs on it)."""
from __future__ import annotations

import torch


def pointwise(target) -> bool:
    """An elementwise op (torch's own tag): each output element from the inputs' elements at its place."""
    return torch.Tag.pointwise in getattr(target, "tags", ())


def op_name(target) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
