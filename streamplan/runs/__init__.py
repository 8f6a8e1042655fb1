"""How each kind of spec runs on a call: a registry keyed by spec type (as torchao dispatches ``quantize_`` configs).
A handler receives the handle (options, planning, notes) and the installed entry; a new spec type registers here."""
from __future__ import annotations

from typing import Any, Callable

HANDLERS: dict[type, Callable[..., Any]] = {}


def handles(spec_type: type) -> Callable:
    def register(fn: Callable) -> Callable:
        HANDLERS[spec_type] = fn
        return fn
    return register


def run_spec(handle, entry, args: tuple, kwargs: dict) -> Any:
    return HANDLERS[type(entry.spec)](handle, entry, args, kwargs)


from . import graph, model, parts  # noqa: E402,F401  (each registers its handlers)
