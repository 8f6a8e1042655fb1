"""Modules a capture cannot (or should not) trace but whose kind declares them row-local
(``registries.OPAQUE_LAYERS``): bitsandbytes' 8-bit and 4-bit linears, whose matmul reads the real parameter's
quantisation state, and mixture-of-experts feed-forwards, whose routing gathers each expert's tokens by value. While a
block is captured, each such module is one ``streamplan::opaque_module`` op (its output shaped from its input, what it
allocates inside written into the op's arguments), row-local for the analysis; when the graph runs, the op calls that
module of the block being run (by its name inside the block: a capture serves every block of its class) on the
chunk's rows, through its own forward."""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch
from torch import nn

from ..registries import OPAQUE_LAYERS, OpaqueKind, register_capture_context, register_row_local_op

_RUNNING = threading.local()


class OpaqueRefused(Exception):
    """A module of a known opaque kind that may not run on a chunk's rows (a router that drops tokens over capacity):
    the block's capture fails with this reason, and the block stays stock."""


def _call(name: str, x: torch.Tensor):
    """The module ``name`` of the block being run, through its own forward."""
    stack = getattr(_RUNNING, "blocks", None)
    if not stack:
        raise RuntimeError(f"streamplan::opaque_module({name!r}) called outside a streamed block's run")
    return stack[-1].get_submodule(name)(x)


@torch.library.custom_op("streamplan::opaque_module", mutates_args=())
def opaque_module(x: torch.Tensor, name: str, out_features: int, call_bytes: int, row_bytes: int, flops_row: float,
                  launches: int) -> torch.Tensor:
    return _call(name, x)


@opaque_module.register_fake
def _(x: torch.Tensor, name: str, out_features: int, call_bytes: int, row_bytes: int, flops_row: float,
      launches: int) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] + (out_features,))


register_row_local_op("streamplan", "opaque_module", "norm")   # a row's features in, the same row's features out


@torch.library.custom_op("streamplan::opaque_module_pair", mutates_args=())
def opaque_module_pair(x: torch.Tensor, name: str, out_features: int, call_bytes: int, row_bytes: int,
                       flops_row: float, launches: int, second_features: int, second_dtype: torch.dtype,
                       flat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A module whose forward returns its rows and a per-token tensor beside them (router scores)."""
    out, second = _call(name, x)
    return out, second


@opaque_module_pair.register_fake
def _(x: torch.Tensor, name: str, out_features: int, call_bytes: int, row_bytes: int, flops_row: float,
      launches: int, second_features: int, second_dtype: torch.dtype, flat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = (math.prod(x.shape[:-1]),) if flat else tuple(x.shape[:-1])
    return x.new_empty(x.shape[:-1] + (out_features,)), x.new_empty(tokens + (second_features,), dtype=second_dtype)


register_row_local_op("streamplan", "opaque_module_pair", "rows")   # both outputs per token
OPS = (torch.ops.streamplan.opaque_module.default, torch.ops.streamplan.opaque_module_pair.default)


def work(node: torch.fx.Node) -> tuple[float, int]:
    """(FLOPs per row of the call, kernel launches per call) an opaque module's kind declared at capture: the time
    model's measure of a module it cannot see into."""
    return float(node.args[5]), int(node.args[6])


def workspace_bytes(node: torch.fx.Node, rows: int) -> int:
    """What an opaque module may allocate inside its call on ``rows`` rows besides its output, at most, as its kind
    declared at capture (a 4-bit linear's dequantised weight; an expert's routed copies of the chunk's rows)."""
    if node.target not in OPS:
        return 0
    call_bytes, row_bytes = node.args[3], node.args[4]
    return int(call_bytes) + int(row_bytes) * rows


def opaque_layers(block: nn.Module) -> list[tuple[str, nn.Module, OpaqueKind]]:
    """The outermost modules inside ``block`` of a registered opaque kind (one inside another runs inside it)."""
    found: list[tuple[str, nn.Module, OpaqueKind]] = []
    for name, m in block.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        kind = next((k for k in OPAQUE_LAYERS if k.matches(m)), None)
        if kind is not None:
            found.append((name, m, kind))
    return found


@contextlib.contextmanager
def running(block: nn.Module) -> Iterator[None]:
    """The block whose modules ``opaque_module`` calls while its graph runs."""
    stack = _RUNNING.__dict__.setdefault("blocks", [])
    stack.append(block)
    try:
        yield
    finally:
        stack.pop()


def _as_op(name: str, m: nn.Module, kind: OpaqueKind, second: tuple | None):
    def forward(x: torch.Tensor, *rest, **kw) -> torch.Tensor:
        if rest or kw:   # the op takes the rows alone: a call with more cannot be replayed by name
            raise OpaqueRefused(f"{type(m).__name__} {name} ({kind.name}) called with more than its input rows")
        call_bytes, per_token = kind.workspace(m, x)
        out_features = int(kind.out_features(m, x))
        flops, launches = kind.work(m, x) or (2.0 * int(x.shape[-1]) * out_features, 1)
        batch = math.prod(int(d) for d in x.shape[:-2])   # per row of the call: every batch element's token
        common = (x, name, out_features, int(call_bytes), int(per_token) * batch, float(flops) * batch,
                  int(launches))
        if second is None:
            return torch.ops.streamplan.opaque_module(*common)
        return torch.ops.streamplan.opaque_module_pair(*common, *second)
    return forward


@contextlib.contextmanager
def _as_ops(layers: list[tuple[str, nn.Module, OpaqueKind]]) -> Iterator[None]:
    seconds = [kind.second(m) for _, m, kind in layers]   # learnt before the trace: a kind may run the module
    for (name, m, kind), second in zip(layers, seconds):
        m.forward = _as_op(name, m, kind, second)
    try:
        yield
    finally:
        for _, m, _ in layers:
            m.__dict__.pop("forward", None)


def _while_traced(block: nn.Module):
    layers = opaque_layers(block)
    for name, m, kind in layers:
        why = kind.refusal(m)
        if why:
            raise OpaqueRefused(f"{type(m).__name__} {name}: {why}")
    return _as_ops(layers) if layers else None


register_capture_context(_while_traced)
