"""transformers' gated MLPs of the Llama family (Llama, Mistral, Qwen2/3, ...), recognised by their forward."""
from __future__ import annotations

import sys

from torch import nn

from ..ir import MLPSpec, Skip
from .checks import elementwise, same_code, stock_problem


def _reference_forward():
    from transformers.models.llama.modeling_llama import LlamaMLP
    return LlamaMLP.forward


def recognize_gated_mlp(name: str, module: nn.Module) -> MLPSpec | Skip | None:
    if "transformers" not in sys.modules:
        return None
    if not all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    ref = _reference_forward()
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if not same_code(type(module).forward, ref):
        return skip("gate/up/down MLP whose forward is not the Llama-family forward")
    problem = stock_problem(module)
    if problem:
        return skip(problem)
    act = elementwise(module.act_fn)
    if act is None:
        return skip(f"activation {type(module.act_fn).__name__} is not known to be elementwise")
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    if not (gate.out_features == up.out_features == down.in_features):
        return skip("projection widths do not line up")
    return MLPSpec(module=module, label=f"transformers.{type(module).__name__}[gated {type(act).__name__}]",
                   layout="gated-separate", in_proj=up, out_proj=down, act=act, ffn=up.out_features, gate_proj=gate)
