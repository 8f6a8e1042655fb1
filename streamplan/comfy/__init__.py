"""streamplan inside ComfyUI: ``patch`` a ``ModelPatcher`` so its diffusion-model blocks stream (a clone, through
ComfyUI's own "dit" block replacements and a ``DIFFUSION_MODEL`` wrapper that streams Wan's and MiniMax-H3's own
forward), ``report`` what they did; the "Stream Blocks" node is in ``nodes``, budgets in ``memory``.

Importing this package does not import ComfyUI; ``nodes`` does (``comfy_api``)."""
from __future__ import annotations

from .patch import LEFT_TO_EXISTING, block_keys, patch, report

__all__ = ["patch", "report", "block_keys", "LEFT_TO_EXISTING"]
