"""diffusers' ``FeedForward`` with each activation it offers."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...specs import MLPSpec, Skip
from ...recognize.checks import elementwise, stock_problem


def _approximate_gelu(x: torch.Tensor) -> torch.Tensor:
    # diffusers.models.activations.ApproximateGELU applies this after its projection
    return x * torch.sigmoid(1.702 * x)


def recognize_feedforward(name: str, module: nn.Module) -> MLPSpec | Skip | None:
    if "diffusers" not in sys.modules:
        return None
    from diffusers.models import activations as da
    from diffusers.models.attention import FeedForward

    if not isinstance(module, FeedForward):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    problem = stock_problem(module, FeedForward.forward)
    if problem:
        return skip(problem)
    net = list(module.net)
    first, rest = net[0], net[1:]
    linears = [m for m in rest if isinstance(m, nn.Linear)]
    if len(linears) != 1 or not all(isinstance(m, (nn.Dropout, nn.Linear)) for m in rest):
        return skip("net is not [activation, dropout, linear, (dropout)]")
    out_proj = linears[0]
    kind = type(first)
    if kind is da.GELU:
        spec = ("plain", first.gelu, f"gelu{'-' + first.approximate if first.approximate != 'none' else ''}")
    elif kind is da.ApproximateGELU:
        spec = ("plain", _approximate_gelu, "gelu-sigmoid-approximate")
    elif kind is da.LinearActivation:
        act = elementwise(first.activation)
        if act is None:
            return skip(f"activation {type(first.activation).__name__} is not known to be elementwise")
        spec = ("plain", act, f"linear-{type(first.activation).__name__.lower()}")
    elif kind is da.GEGLU:
        if getattr(da, "is_torch_npu_available", lambda: False)():
            return skip("GEGLU takes the NPU fused kernel path")
        spec = ("gated-fused", first.gelu, "geglu")
    elif kind is da.SwiGLU:
        act = elementwise(first.activation)
        if act is None:
            return skip(f"activation {type(first.activation).__name__} is not known to be elementwise")
        spec = ("gated-fused", act, "swiglu")
    else:
        return skip(f"activation module {kind.__name__} is not known")
    layout, act, act_name = spec
    proj = first.proj
    ffn = proj.out_features if layout == "plain" else proj.out_features // 2
    if out_proj.in_features != ffn:
        return skip("projection widths do not line up")
    return MLPSpec(module=module, label=f"diffusers.FeedForward[{act_name}]", layout=layout, in_proj=proj,
                   out_proj=out_proj, act=act, ffn=ffn)
