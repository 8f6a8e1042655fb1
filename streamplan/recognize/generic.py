"""The generic way in: any block no hand-written recognizer claims, streamed from its captured graph. Candidates are
the elements of a ``ModuleList`` (how every library stacks its blocks) that have parts of their own, and a root
applied to directly; whether one really streams is decided at its first call, from the graph."""
from __future__ import annotations

from torch import nn

from ..specs import GraphSpec, Skip
from ..registries import OPAQUE_LAYERS, OpaqueKind, register_opaque_layer
from ..plan.weight_formats import linear_caps
from .checks import stock_problem


def block_candidates(root: nn.Module) -> set[int]:
    """ids of the modules the generic path may take: ModuleList elements with at least two children and two linear
    layers inside (an attention and more), none inside a module a capture takes whole (a mixture of experts' list of
    experts); the root itself when it holds no such list."""
    found: set[int] = set()
    opaque = {id(x) for m in root.modules() if any(k.matches(m) for k in OPAQUE_LAYERS) for x in m.modules()}
    for m in root.modules():
        if isinstance(m, nn.ModuleList) and id(m) not in opaque:
            for child in m:
                if _block_like(child):
                    found.add(id(child))
    if not found and _block_like(root) and not isinstance(root, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        found.add(id(root))
    return found


def part_candidates(root: nn.Module, blocks: set[int]) -> set[int]:
    """ids of the direct children of the blocks in ``blocks`` that look like blocks themselves (a cross-attention, an
    MLP in a ``Sequential``): where no part recognizer knows one, it streams from its own captured graph on the calls
    its block's graph cannot take (the block left stock), as a known part would."""
    found: set[int] = set()
    for m in root.modules():
        if id(m) in blocks:
            found.update(id(c) for c in m.children() if _block_like(c) and id(c) not in blocks
                         and not isinstance(c, (nn.ModuleList, nn.ModuleDict)))
    return found


def _block_like(m: nn.Module) -> bool:
    # two linear layers suffice: Flux.2's single block fuses Q, K, V and the MLP input into one projection
    return len(list(m.children())) >= 2 and sum(_linear(x) for x in m.modules()) >= 2


def _linear(m: nn.Module) -> bool:
    """An nn.Linear, or transformers' ``Conv1D`` (GPT-2's linear layer, its weight stored transposed)."""
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and getattr(getattr(m, "weight", None), "dim",
                                                                                  lambda: 0)() == 2)


def recognize_generic(name: str, module: nn.Module) -> GraphSpec | Skip:
    # the graph run onloads hooked leaves (execute.hook_chains); weight formats say whether a capture traces them
    problem = stock_problem(module, onloads=True)
    if problem:
        return Skip(name, type(module).__name__, problem)
    lib = type(module).__module__.split(".")[0]
    return GraphSpec(module, f"captured {lib}.{type(module).__name__}")


def _opaque_format(module: nn.Module) -> bool:
    """A layer whose weight format a capture takes as one opaque row-local op (``weight_formats.LinearCaps.opaque``)."""
    return hasattr(module, "weight") and linear_caps(module).opaque


def _dequantised_weight(module: nn.Module, x) -> tuple[int, int]:
    """bitsandbytes' 4-bit matmul dequantises the whole weight per call (so per chunk), in the input's dtype."""
    return module.in_features * module.out_features * x.element_size(), 0


register_opaque_layer(OpaqueKind("quantised linear", _opaque_format, lambda m, x: m.out_features,
                                 _dequantised_weight))
