"""How a ComfyUI block's calls reach its ``BlockStreamer``, per block class: a registry, so a family whose block the
capture cannot take as ComfyUI calls it (MiniMax-H3: 2-D packed rows, per-segment modulation) brings its own adapter
(``streamplan.recognize.comfy_h3``) and every other block is streamed as it is called."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..recognize import comfy_h3


def _as_called(streamer: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The block streamed with the host's own arguments. Its transformer_options were checked by the caller and hold
    nothing that changes the block's math: the block (and its capture) get an empty one."""
    if "transformer_options" in kwargs:
        kwargs = {**kwargs, "transformer_options": {}}
    return streamer(*args, **kwargs)


@dataclass(frozen=True)
class BlockCalls:
    """``streamed(block)``: the module its streamer runs; ``call(streamer, streamed, args, kwargs)``: one host call
    through it, returning the block's output or a string saying why this call runs stock; ``img_dims``: the rank of
    the hidden states the host hands the block (``args["img"]``); ``host_attention``: whether a call the streamer
    runs stock still gets the host's transformer_options (so an attention override is honoured there too)."""

    streamed: Callable[[nn.Module], nn.Module] = lambda block: block
    call: Callable[[Callable, nn.Module, tuple, dict], Any] = _as_called
    img_dims: int = 3
    host_attention: bool = False


DEFAULT = BlockCalls()
_REGISTRY: dict[str, BlockCalls] = {}


def class_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def register_block_calls(path: str, calls: BlockCalls) -> None:
    """Route the calls of blocks of the class at ``path`` ("package.module.Class") through ``calls``."""
    _REGISTRY[path] = calls


def block_calls(module: nn.Module) -> BlockCalls:
    return _REGISTRY.get(class_path(module), DEFAULT)


register_block_calls(comfy_h3.CLASS_PATH, BlockCalls(comfy_h3.PackedRows, comfy_h3.stream_call, img_dims=2,
                                                     host_attention=True))
