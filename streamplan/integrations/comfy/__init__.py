"""streamplan inside ComfyUI: ``patch`` a ``ModelPatcher`` so its diffusion-model blocks stream (a clone, through
ComfyUI's own "dit" block replacements and a ``DIFFUSION_MODEL`` wrapper that streams the model forwards streamplan
follows), ``report`` what they did; the "Stream Blocks" node is in ``nodes``, budgets in ``memory``. The files that
declare ComfyUI's ops, records and attention to the captured path (``kitchen_ops``, ``flux``, ``capture_attention``,
``h3``, ``models``) are imported by the recognizers without the rest.

Importing this package imports neither ComfyUI nor ``patch``: the public names load on first use, so the declaration
files can be imported below ``streamplan.api``, which ``patch`` uses."""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["patch", "report", "block_keys", "LEFT_TO_EXISTING"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(f"{__name__}.patch"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the submodule ``patch`` would set the package attribute ``patch`` to that module; the public name is
    the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
