"""Recognizers: known modules in, specs out; anything claimed but not safe comes back as a ``Skip``."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..ir import AttentionSpec, BlockSpec, GraphSpec, MLPSpec, ModelSpec, Skip
from . import comfy_kitchen_ops  # noqa: F401  (declares comfy_kitchen's row-local ops)
from .diffusers_attention import recognize_attention
from .diffusers_flux import recognize_flux_attention, recognize_flux_block
from .diffusers_mlp import recognize_feedforward
from .diffusers_h3 import recognize_h3_model
from .diffusers_wan import recognize_wan_attention, recognize_wan_block, recognize_wan_model
from .generic import block_candidates, recognize_generic
from .row_local import recognize_row_local
from .transformers_llama import recognize_gated_mlp, recognize_llama_attention, recognize_llama_layer

Recognizer = Callable[[str, nn.Module], "MLPSpec | AttentionSpec | BlockSpec | ModelSpec | Skip | None"]

# whole models: their forward is replaced, and their blocks are still recognised on their own
MODEL_RECOGNIZERS: list[Recognizer] = [recognize_wan_model, recognize_h3_model]
# blocks first: a recognised block claims its attention and MLP; a block left stock leaves them to their own
BLOCK_RECOGNIZERS: list[Recognizer] = [recognize_wan_block, recognize_flux_block, recognize_llama_layer]
RECOGNIZERS: list[Recognizer] = BLOCK_RECOGNIZERS + [recognize_feedforward, recognize_gated_mlp, recognize_attention,
                                  recognize_wan_attention, recognize_flux_attention, recognize_llama_attention,
                                                      recognize_row_local]


CAPTURE_MODES = ("fallback", "prefer", "off")


def recognize(root: nn.Module, capture: str = "fallback") -> tuple[
        dict[str, MLPSpec | AttentionSpec | BlockSpec | ModelSpec | GraphSpec], list[Skip]]:
    """Walk ``root`` top-down; a recognised module's children are not visited again. ``capture``: "fallback" streams
    blocks no hand-written recognizer knows from their captured graph, "prefer" does so for every block (model
    forwards stay hand-written), "off" uses hand-written recognizers only."""
    specs: dict[str, MLPSpec | AttentionSpec | BlockSpec | ModelSpec | GraphSpec] = {}
    skipped: list[Skip] = []
    claimed: list[str] = []
    candidates = block_candidates(root) if capture != "off" else set()
    for name, module in root.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed if c) or "" in claimed:
            continue
        model = next((m for m in (rec(name, module) for rec in MODEL_RECOGNIZERS) if m is not None), None)
        if model is not None:
            (skipped.append if isinstance(model, Skip) else lambda s: specs.__setitem__(name, s))(model)
            continue
        hand = {rec: rec(name, module) for rec in RECOGNIZERS} if id(module) in candidates else {}
        if id(module) in candidates and (capture == "prefer" or all(v is None for v in hand.values())):
            found = recognize_generic(name, module)   # a block no hand-written recognizer knows: from its graph
            (skipped.append if isinstance(found, Skip) else lambda s: specs.__setitem__(name, s))(found)
            claimed.append(name)
            continue
        if (hand and not any(v is not None and not isinstance(v, Skip) for v in hand.values())
                and any(isinstance(hand[rec], Skip) for rec in BLOCK_RECOGNIZERS)):
            # a block a hand-written recognizer knows the family of but not this forward (Mistral, Qwen, Gemma, ...):
            # from its graph, with its children's own specs installed too for calls the graph cannot take (a cache)
            found = recognize_generic(name, module, fallback=True)
            if not isinstance(found, Skip):
                specs[name] = found
                continue
        for rec in RECOGNIZERS:
            found = rec(name, module)
            if found is None:
                continue
            if isinstance(found, Skip):
                skipped.append(found)
                if rec in BLOCK_RECOGNIZERS:
                    break  # its attention and MLP are still considered on their own
            else:
                specs[name] = found
            claimed.append(name)
            break
    return specs, skipped
