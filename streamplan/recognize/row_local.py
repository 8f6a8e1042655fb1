"""Row-local modules left outside recognised blocks (a model's final norm, a modulated output norm)."""
from __future__ import annotations

import sys

from torch import nn

from ..specs import RowLocalSpec, Skip
from .checks import same_code, stock_problem


def recognize_row_local(name: str, module: nn.Module) -> RowLocalSpec | Skip | None:
    tf = sys.modules.get("transformers.models.llama.modeling_llama")
    if tf is not None and hasattr(module, "variance_epsilon") and hasattr(module, "weight"):
        if not same_code(type(module).forward, tf.LlamaRMSNorm.forward):
            return None
        problem = stock_problem(module)
        if problem:
            return Skip(name, type(module).__name__, problem)
        # fp32 copy, its square, the normalised fp32, the cast, the weighted result
        return RowLocalSpec(module, f"transformers.{type(module).__name__}", transient_per_elem=7)
    dn = sys.modules.get("diffusers.models.normalization")
    if dn is not None and type(module) is getattr(dn, "AdaLayerNormContinuous", None):
        if not isinstance(module.norm, nn.LayerNorm) and type(module.norm).__name__ != "RMSNorm":
            return Skip(name, type(module).__name__, f"norm {type(module.norm).__name__} is not known")
        problem = stock_problem(module)
        if problem:
            return Skip(name, type(module).__name__, problem)
        return RowLocalSpec(module, "diffusers.AdaLayerNormContinuous", transient_per_elem=3)
    return None
