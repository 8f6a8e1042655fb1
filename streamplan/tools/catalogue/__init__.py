"""Test cases for the generic (captured-graph) path and the coverage catalogue built from them.

``diffusers_cases.CASES`` and ``transformers_cases.CASES`` map a case name to a ``Case``: a tiny random-weight block
of a real library class and the inputs its model hands it. ``python -m streamplan.tools.catalogue`` runs them and prints
what streamplan does with every block class of the pinned libraries (``table.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    name: str
    cls_path: str                                                       # "package.module:ClassName"
    build: Callable[[], nn.Module]                                      # a fresh block in eval mode
    inputs: Callable[[int, torch.device, torch.dtype], tuple[tuple, dict]]   # (args, kwargs) for n rows
    note: str = ""
    row_output: int | None = 0        # which flat output holds the n rows (None: the output is one tensor)
    streams: bool = True              # whether the generic path is expected to stream it (else: stays stock)


__all__ = ["Case"]
