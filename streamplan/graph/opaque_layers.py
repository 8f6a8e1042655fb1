"""Linear layers a capture cannot trace but whose format declares them row-local (``registries.OPAQUE_LAYERS``, filled
from ``plan.weight_formats.LinearCaps.opaque`` by ``recognize.generic``: bitsandbytes' 8-bit and 4-bit linears, whose
matmul reads the real parameter's quantisation state). While a block is captured, each such layer is one
``streamplan::opaque_linear`` op (its output shaped from its input), row-local for the analysis; when the graph runs,
the op calls that layer of the block being run (by its name inside the block: a capture serves every block of its class)
on the chunk's rows, through the layer's own forward."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

from ..registries import OPAQUE_LAYERS, register_capture_context, register_row_local_op

_RUNNING = threading.local()


@torch.library.custom_op("streamplan::opaque_linear", mutates_args=())
def opaque_linear(x: torch.Tensor, name: str, out_features: int) -> torch.Tensor:
    stack = getattr(_RUNNING, "blocks", None)
    if not stack:
        raise RuntimeError(f"streamplan::opaque_linear({name!r}) called outside a streamed block's run")
    return stack[-1].get_submodule(name)(x)


@opaque_linear.register_fake
def _(x: torch.Tensor, name: str, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] + (out_features,))


register_row_local_op("streamplan", "opaque_linear", "norm")   # a row's features in, the same row's features out


def workspace_bytes(node: torch.fx.Node) -> int:
    """What an opaque layer may allocate inside its call besides its output, at most: its weight in the input's dtype
    (bitsandbytes' 4-bit matmul dequantises the whole weight per call, so per chunk). Row-independent."""
    if node.target is not torch.ops.streamplan.opaque_linear.default:
        return 0
    x = node.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor):
        return 0
    in_features, out_features = x.shape[-1], node.args[2]
    return int(in_features) * int(out_features) * x.element_size()


def opaque_layers(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in block.named_modules() if name and any(match(m) for match in OPAQUE_LAYERS)]


@contextlib.contextmanager
def running(block: nn.Module) -> Iterator[None]:
    """The block whose layers ``opaque_linear`` calls while its graph runs."""
    stack = _RUNNING.__dict__.setdefault("blocks", [])
    stack.append(block)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def _as_ops(layers: list[tuple[str, nn.Module]]) -> Iterator[None]:
    for name, m in layers:
        m.forward = lambda x, _n=name, _o=m.out_features: torch.ops.streamplan.opaque_linear(x, _n, _o)
    try:
        yield
    finally:
        for _, m in layers:
            m.__dict__.pop("forward", None)


def _while_traced(block: nn.Module):
    layers = opaque_layers(block)
    return _as_ops(layers) if layers else None


register_capture_context(_while_traced)
