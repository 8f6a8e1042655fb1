"""ComfyUI's attention while one of its blocks is captured. ComfyUI binds ``optimized_attention`` (and
``optimized_attention_masked``) at start-up to the function its flags select (Sage, flash, xformers, split,
sub-quadratic, PyTorch) and every model module imports that binding. Only PyTorch's traces to the SDPA the analysis
streams, so while a block is captured the selected function's bindings in ComfyUI's modules are ComfyUI's own
``attention_pytorch``; afterwards they are restored, and the streamed chunks go to the selected function through the
ComfyUI consumer (``streamplan.integrations.comfy.attention``), which reads ``comfy.ldm.modules.attention`` when it
attends. MiniMax-H3's adapter gets the same effect through an attention override at its capture (``h3``)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from torch import nn

from ...registries import register_capture_context

ATTENTION_MODULE = "comfy.ldm.modules.attention"


def _pytorch_attention_while_traced(block: nn.Module):
    if not any(type(m).__module__.startswith("comfy.") for m in block.modules()):   # a block, or an adapter over one
        return None
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is None:
        return None
    pytorch = attention.attention_pytorch
    selected = [f for f in (attention.optimized_attention, getattr(attention, "optimized_attention_masked", None))
                if f is not None and f is not pytorch]
    return _bound_to(selected, pytorch) if selected else None


@contextmanager
def _bound_to(selected: list, pytorch) -> Iterator[None]:
    """Every global of a loaded ``comfy`` module bound to a selected function (a binding such as
    ``optimized_attention``, not the function's own name), bound to ``pytorch`` for the block."""
    swapped = []
    try:
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "comfy" or name.startswith("comfy.")):
                continue
            for attr, value in list(vars(module).items()):
                if any(value is f for f in selected) and attr != getattr(value, "__name__", None):
                    swapped.append((module, attr, value))
                    setattr(module, attr, pytorch)
        yield
    finally:
        for module, attr, value in reversed(swapped):
            setattr(module, attr, value)


register_capture_context(_pytorch_attention_while_traced)
