"""How each kind of spec runs on a call: one table keyed by spec type (as torchao dispatches ``quantize_`` configs).
A handler receives the call's context (``context.CallContext``: the installed entry, options, a notes sink, the planner)
and the call's arguments; a new spec type gets a row here."""
from __future__ import annotations

from typing import Any, Callable

from .context import CallContext
from ..specs import AttentionSpec, GraphSpec, MLPSpec, ModelSpec, RowLocalSpec
from .graph_call import run_graph
from .model_call import run_model
from .part_calls import run_row_local, run_mlp_spec, run_attention_spec
from .replay import run_replayed

HANDLERS: dict[type, Callable[..., Any]] = {
    GraphSpec: run_graph,
    ModelSpec: run_model,
    RowLocalSpec: run_row_local,
    MLPSpec: run_mlp_spec,
    AttentionSpec: run_attention_spec,
}


def run_spec(ctx: CallContext, args: tuple, kwargs: dict) -> Any:
    handler = HANDLERS[type(ctx.entry.spec)]
    if type(ctx.entry.spec) is GraphSpec:   # in a rehearsal, a block whose twin ran is replayed
        return run_replayed(ctx, args, kwargs, handler)
    return handler(ctx, args, kwargs)
