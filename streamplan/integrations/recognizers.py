"""Recognizers: known modules in, specs out; anything claimed but not safe comes back as a ``Skip``."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..recognize.generic import block_candidates, part_candidates, recognize_generic
from ..recognize.row_local import recognize_row_local
from ..specs import AttentionSpec, GraphSpec, MLPSpec, ModelSpec, RowLocalSpec, Skip
# imported for what they declare at import: hook chains, row-local ops, argument records, capture contexts, state
from . import accelerate, peft  # noqa: F401  (accelerate's hook chains; the adapter state peft's layers read)
from . import experts  # noqa: F401  (mixture-of-experts feed-forwards, taken whole by a capture)
from .comfy import capture_attention, flux, kitchen_ops  # noqa: F401  (ComfyUI's ops, records, capture attention)
from .diffusers import caches, hooks, pipelines  # noqa: F401  (diffusers' read caches, hook chains, pipelines' denoisers)
from .diffusers.anyflow import recognize_anyflow_far_attention
from .diffusers.attention import recognize_attention
from .diffusers.flex import recognize_flex_attention
from .diffusers.flex_nabla import recognize_nabla_attention
from .diffusers.h3 import recognize_h3_model
from .diffusers.ltx2 import recognize_ltx2_model
from .diffusers.mlp import recognize_feedforward
from .diffusers.mochi import recognize_mochi_attention
from .diffusers.wan import recognize_wan_model
from .transformers import graph_calls  # noqa: F401  (transformers layers on the captured path: backend, cache)
from .transformers.decoders import recognize_decoder_model
from .transformers.llama import recognize_gated_mlp, recognize_llama_attention

Recognizer = Callable[[str, nn.Module], "MLPSpec | AttentionSpec | ModelSpec | RowLocalSpec | Skip | None"]

# whole models: their forward is replaced, and their blocks are still recognised on their own
MODEL_RECOGNIZERS: list[Recognizer] = [recognize_wan_model, recognize_h3_model, recognize_ltx2_model,
                                        recognize_decoder_model]
# parts: what a block's graph cannot take (a cache) or a module outside any block
RECOGNIZERS: list[Recognizer] = [recognize_feedforward, recognize_gated_mlp, recognize_attention,
                                 recognize_flex_attention, recognize_nabla_attention, recognize_mochi_attention,
                                 recognize_anyflow_far_attention, recognize_llama_attention, recognize_row_local]


CAPTURE_MODES = ("fallback", "prefer", "off")


def _first(name: str, module: nn.Module):
    return next((found for found in (rec(name, module) for rec in RECOGNIZERS) if found is not None), None)


def recognize(root: nn.Module, capture: str = "fallback") -> tuple[
        dict[str, MLPSpec | AttentionSpec | ModelSpec | RowLocalSpec | GraphSpec], list[Skip]]:
    """Walk ``root`` top-down. A block (``block_candidates``) streams from its captured graph, and its parts keep
    their own specs for the calls the graph cannot take: a part no recognizer knows that looks like a block (a
    cross-attention, an MLP; ``part_candidates``) its own captured graph. Any other recognised module's children are
    not visited again. ``capture``: "fallback" (default) lets a part recognizer that knows the block itself (an MLP in
    a list of experts) take it, "prefer" captures every block, "off" never captures (parts only)."""
    specs: dict[str, MLPSpec | AttentionSpec | ModelSpec | RowLocalSpec | GraphSpec] = {}
    skipped: list[Skip] = []
    claimed: list[str] = []
    graphs: list[str] = []
    candidates = block_candidates(root) if capture != "off" else set()
    parts = part_candidates(root, candidates)
    for name, module in root.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed if c) or "" in claimed:
            continue
        model = next((m for m in (rec(name, module) for rec in MODEL_RECOGNIZERS) if m is not None), None)
        if model is not None:
            (skipped.append if isinstance(model, Skip) else lambda s: specs.__setitem__(name, s))(model)
            continue
        found = _first(name, module)
        if (id(module) in candidates and (capture == "prefer" or found is None or isinstance(found, Skip))) or \
                (id(module) in parts and found is None):
            graph = recognize_generic(name, module)
            if isinstance(graph, Skip):
                skipped.append(graph)        # its parts are still considered on their own
            else:
                specs[name] = graph
                graphs.append(name)
            continue
        if found is None:
            continue
        (skipped.append if isinstance(found, Skip) else lambda s: specs.__setitem__(name, s))(found)
        claimed.append(name)
    for name in graphs:   # say where a refused graph call still streams its parts
        if any(other.startswith(name + ".") or (not name and other) for other in specs if other != name):
            specs[name].label += " (else its parts)"
    return specs, skipped
