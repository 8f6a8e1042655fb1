"""streamplan inside ComfyUI: ``patch`` a ``ModelPatcher`` so its diffusion-model blocks stream (a clone, through
ComfyUI's own "dit" block replacements), ``report`` what they did; the "Stream Blocks" node is in ``nodes``.

Importing this package does not import ComfyUI; ``nodes`` does (``comfy_api``)."""
from __future__ import annotations

from .patch import LEFT_TO_EXISTING, block_keys, patch, report

__all__ = ["patch", "report", "block_keys", "LEFT_TO_EXISTING"]
