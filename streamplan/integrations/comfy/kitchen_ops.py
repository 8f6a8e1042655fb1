"""comfy_kitchen (ComfyUI's fused kernels): the custom ops its DiT blocks call, declared row-local for the
captured-graph analysis. Each was read in comfy_kitchen's eager reference (backends/eager): rotary applies a row's own
table row to that row; the norms normalise a row's features and modulate them elementwise; the INT8 linear quantizes
each input row on its own (a per-row scale, ConvRot's Hadamard rotation within a row's feature groups) before one
integer matmul, so a row's output is its own row's."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ...registries import register_capture_context, register_row_local_op

# the in-place forms (``_``) write the same rows into their q and k arguments (MiniMax-H3's DiTBlock at inference);
# the analysis checks those are per-call values with rows
for _name in ("apply_rope1", "apply_rope", "rms_rope_split_half1", "rms_rope_split_half", "rms_rope_split_half1_",
              "rms_rope_split_half_"):
    register_row_local_op("comfy_kitchen", _name, "rows")
for _name in ("rms_adaln", "adaln", "int8_linear"):
    register_row_local_op("comfy_kitchen", _name, "norm")


def _int8_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, convrot: bool = False, convrot_groupsize: int = 256,
                    input_act: str | None = None) -> torch.Tensor:
    """``comfy_kitchen.int8_linear`` through its registered op: the same backend choice as the Python function, behind
    the op's fake kernel, so a capture keeps one op where tracing the eager kernel would fix the row count (its loop
    over the rows in blocks)."""
    from comfy_kitchen.backends.eager.quantization import DTYPE_TO_CODE
    return torch.ops.comfy_kitchen.int8_linear(x, weight, weight_scale, bias,
                                               DTYPE_TO_CODE[out_dtype or torch.bfloat16], convrot,
                                               convrot_groupsize, input_act)


@torch.library.custom_op("streamplan::kitchen_eager_int8_linear", mutates_args=())
def _eager_int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype | None, convrot: bool, convrot_groupsize: int) -> torch.Tensor:
    """comfy_kitchen's eager INT8 linear as one op (its W4A8 eager path calls it directly, not through the registry)."""
    from comfy_kitchen.backends.eager.quantization import int8_linear
    return int8_linear(x, weight, weight_scale, bias=bias, out_dtype=out_dtype, convrot=convrot,
                       convrot_groupsize=convrot_groupsize)


@_eager_int8_linear.register_fake
def _(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize):
    # no dtype: the kernel's float32 scaling is left as it is
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype or torch.float32)


def _eager_int8_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = torch.bfloat16,
                          convrot: bool = False, convrot_groupsize: int = 256, input_act: str | None = None
                          ) -> torch.Tensor:
    if input_act is not None:   # not a call the W4A8 path makes: keep the traced kernel (the capture then names it)
        from comfy_kitchen.backends.eager.quantization import int8_linear
        return int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)
    return torch.ops.streamplan.kitchen_eager_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot,
                                                          convrot_groupsize)


# (module, attribute) -> what stands in for it while a block is captured: ComfyUI's fused-activation linear
# (``comfy.ops.linear_input_act``, the MLP down projection of Wan, LTX-Video and MiniMax-H3 on INT8 weights) calls
# ``comfy_kitchen.int8_linear`` directly, and the eager W4A8 linear its module's ``int8_linear``
_TRACED_AS_OPS = {("comfy_kitchen", "int8_linear"): _int8_linear_op,
                  ("comfy_kitchen.backends.eager.w4a8_int8", "int8_linear"): _eager_int8_linear_op}


def _int8_linear_while_traced(block: nn.Module):
    if not any(type(m).__module__.startswith("comfy.") for m in block.modules()):
        return None
    found = [(sys.modules[m], name, op) for (m, name), op in _TRACED_AS_OPS.items()
             if hasattr(sys.modules.get(m), name)]
    return _swapped(found) if found and hasattr(torch.ops.comfy_kitchen, "int8_linear") else None


@contextmanager
def _swapped(found: list) -> Iterator[None]:
    kept = [(module, name, getattr(module, name)) for module, name, _ in found]
    for module, name, op in found:
        setattr(module, name, op)
    try:
        yield
    finally:
        for module, name, python in kept:
            setattr(module, name, python)


register_capture_context(_int8_linear_while_traced)
register_row_local_op("streamplan", "kitchen_eager_int8_linear", "norm")
