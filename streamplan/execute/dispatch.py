"""How each kind of spec runs on a call: one table keyed by spec type (as torchao dispatches ``quantize_`` configs).
A handler receives the handle (options, planning, notes) and the installed entry; a new spec type gets a row here."""
from __future__ import annotations

from typing import Any, Callable

from ..specs import AttentionSpec, GraphSpec, MLPSpec, ModelSpec, RowLocalSpec
from .graph_call import run_graph
from .model_call import run_model
from .part_calls import run_row_local, run_mlp_spec, run_attention_spec

HANDLERS: dict[type, Callable[..., Any]] = {
    GraphSpec: run_graph,
    ModelSpec: run_model,
    RowLocalSpec: run_row_local,
    MLPSpec: run_mlp_spec,
    AttentionSpec: run_attention_spec,
}


def run_spec(handle, entry, args: tuple, kwargs: dict) -> Any:
    return HANDLERS[type(entry.spec)](handle, entry, args, kwargs)
