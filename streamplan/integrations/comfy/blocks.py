"""How a ComfyUI block's calls reach its ``BlockStreamer``, per block class: a registry, so a family whose block the
capture cannot take as ComfyUI calls it (MiniMax-H3: 2-D packed rows, per-segment modulation) brings its own adapter
(``streamplan.integrations.comfy.h3``) and every other block is streamed as it is called."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import flux as comfy_flux, forwards_ltxav as comfy_ltxav, h3 as comfy_h3


class HostOptions(nn.Module):
    """A block whose forward takes ``transformer_options``, as its streamer sees it: captured with an empty one (the
    caller checked that nothing in the host's changes the block's math), run stock with the host's own (``host``, set
    per call), so that an attention override a ComfyUI node installed is honoured where the streamer runs it stock."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.training = False          # the block's own flag is checked by the caller; never flipped here
        self.host: dict | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.host is not None and not torch.compiler.is_exporting():
            kwargs = {**kwargs, "transformer_options": self.host}
        return self.block(*args, **kwargs)


_HOST_CLASSES: dict[type, type] = {}


def host_options(block: nn.Module) -> nn.Module:
    """``block`` in a ``HostOptions`` of its class (the capture binds its calls to the block's own signature), or the
    block itself where its forward takes no ``transformer_options``."""
    cls = type(block)
    signature = inspect.signature(cls.forward)
    if "transformer_options" not in signature.parameters:
        return block
    wrapper = _HOST_CLASSES.get(cls)
    if wrapper is None:
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return HostOptions.forward(self, *args, **kwargs)
        forward.__signature__ = signature
        wrapper = _HOST_CLASSES[cls] = type(f"{cls.__name__}HostOptions", (HostOptions,), {"forward": forward})
    return wrapper(block)


def _as_called(streamer: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The block streamed with the host's own arguments. Its transformer_options were checked by the caller and hold
    nothing that changes the block's math: the capture and the streamed run get an empty one, a stock run the host's
    (``HostOptions``)."""
    if "transformer_options" not in kwargs or not isinstance(module, HostOptions):
        return streamer(*args, **kwargs)
    module.host = kwargs["transformer_options"] or {}
    try:
        return streamer(*args, **{**kwargs, "transformer_options": {}})
    finally:
        module.host = None


@dataclass(frozen=True)
class BlockCalls:
    """``streamed(block)``: the module its streamer runs; ``call(streamer, streamed, args, kwargs)``: one host call
    through it, returning the block's output or a string saying why this call runs stock; ``img_dims``: the rank of
    the hidden states the host hands the block (``args["img"]``); ``host_attention``: whether a call the streamer
    runs stock still gets the host's transformer_options (so an attention override is honoured there too);
    ``direct_weights``: the comfy.ops layers (names inside the block) whose weights the block reads itself without
    calling them, left as they are when their per-call casts are taken (``weights.taken``); ``whole_attention``: for
    a block whose stock forward makes one ComfyUI attention call (its global attention), that call as the forward
    makes it, given the whole Q, K and V ``[B, H, N, D]`` and keywords ``transformer_options``, ``scale``, returning
    ``[B, H, N, D]``: an opaque attention override gets it once per block call (None: such overrides keep the block
    stock)."""

    streamed: Callable[[nn.Module], nn.Module] = host_options
    call: Callable[[Callable, nn.Module, tuple, dict], Any] = _as_called
    img_dims: int = 3
    host_attention: bool = True
    direct_weights: tuple[str, ...] = ()
    whole_attention: Callable[..., torch.Tensor] | None = None


DEFAULT = BlockCalls()
_REGISTRY: dict[str, BlockCalls] = {}


def class_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def register_block_calls(path: str, calls: BlockCalls) -> None:
    """Route the calls of blocks of the class at ``path`` ("package.module.Class") through ``calls``."""
    _REGISTRY[path] = calls


def block_calls(module: nn.Module) -> BlockCalls:
    return _REGISTRY.get(class_path(module), DEFAULT)


def _h3_call(streamer: Callable, adapter: comfy_h3.PackedRows, args: tuple, kwargs: dict) -> Any:
    """One host call of the block (``block(x, t_emb, mod_segments, rope_freqs, transformer_options=...)``) through
    ``streamer`` (a ``BlockStreamer`` over ``adapter``): the output (the host's ``x``, updated in place as the stock
    block does), or a string saying why this call must run stock."""
    from ...execute.donation import donate

    block = adapter.block
    why = comfy_h3.forward_problem(block)
    if why:
        return why
    try:
        bound = inspect.signature(type(block).forward).bind(block, *args, **kwargs).arguments
    except TypeError as exc:
        return f"the call does not match DiTBlock.forward ({exc})"
    x, t_emb, rope = bound["x"], bound["t_emb"], bound.get("rope_freqs")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x is not [rows, features] ({getattr(x, 'shape', type(x).__name__)})"
    index = comfy_h3.segment_rows(bound["mod_segments"], x.shape[0], x.device)
    if isinstance(index, str):
        return index
    x3 = x.unsqueeze(0)
    adapter.host = (bound["mod_segments"], bound.get("transformer_options") or {})
    try:
        with donate(x3):   # the block updates x in place and the host rebinds its rows to the output
            out = streamer(x3, t_emb, index, rope)
    finally:
        adapter.host = None
    return out[0]


register_block_calls(comfy_h3.CLASS_PATH, BlockCalls(comfy_h3.PackedRows, _h3_call, img_dims=2,
                                                     host_attention=True, direct_weights=comfy_h3.DIRECT_WEIGHTS,
                                                     whole_attention=comfy_h3.whole_attention))
# Flux's (and HunyuanVideo's, Chroma's) single-stream blocks attend once over their own joint rows: an opaque override
# can get that call with the whole Q; double blocks join text rows the whole-Q path cannot take, and stay stock
register_block_calls(comfy_flux.SINGLE_BLOCK_PATH, BlockCalls(whole_attention=comfy_flux.whole_attention))
# LTX-2's audio-video block updates its (video, audio) inputs in place before an attention over every video row reads
# them: captured on copies (``forwards_ltxav.CopiedInputs``), the stock forward's per-frame tables described
register_block_calls(comfy_ltxav.BLOCK_PATH, BlockCalls(comfy_ltxav.CopiedInputs, comfy_ltxav.streamed_call))
