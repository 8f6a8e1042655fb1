"""streamplan: long-sequence transformer inference in bounded activation memory, with the model's own math.

The public names are loaded on first use (PEP 562), so that ``import streamplan`` and the ``streamplan`` command's
``--help`` / ``--version`` do not pay for importing torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "apply": "api", "StreamHandle": "api", "PipelineHandle": "api", "BlockStreamer": "api",
    "StreamOptions": "options", "verify": "verify",
    "measure_peak": "meter", "parse_budget": "plan.budget", "BudgetError": "plan.planner",
    "HostMemoryError": "plan.planner",
    "register_consumer": "attention", "unregister_consumer": "attention", "ConsumerCaps": "attention",
    "AttentionConsumer": "attention",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")   # streamplan.attention, streamplan.api, ...
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing the submodule ``streamplan.verify`` sets the package attribute ``verify`` to that module; the public
    name ``streamplan.verify`` stays the function, whichever of the two was imported first."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
