"""What an op in a captured graph is, by torch's own names and tags (shared by the analysis and what runs on it)."""
from __future__ import annotations

import torch


class NotRowLocal(Exception):
    """The graph has something streamplan cannot run in row chunks (the message says what)."""


# reductions by name: over the rows they contract every row (``row_contractions``), elsewhere they are row-local
REDUCE_OPS = {"mean", "sum", "amax", "amin", "var", "std", "var_mean", "std_mean", "logsumexp", "prod", "max", "min",
              "argmax", "argmin", "any", "all", "linalg_vector_norm", "norm"}


# elementwise ops torch leaves without its pointwise tag
_UNTAGGED_POINTWISE = {"floor_divide"}


def pointwise(target) -> bool:
    """An elementwise op (torch's own tag): each output element from the inputs' elements at its place."""
    return torch.Tag.pointwise in getattr(target, "tags", ()) or op_name(target) in _UNTAGGED_POINTWISE


def op_name(target) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
