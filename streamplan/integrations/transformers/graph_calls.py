"""What transformers' decoder layers need on the captured path.

The attention backend is the model config's ``_attn_implementation`` (its consumer serves the graph's attention). A
layer called with an empty ``DynamicCache`` (prefill) is captured without it, and its cache is then filled from the
graph's own K and V, as the stock attention would have done; a cache that already holds tokens (decoding, chunked
prefill) or of another kind keeps the stock call, named. The same goes for the caches in ``FILLABLE``: those whose
first update of an empty layer stores what it is given and hands it back unchanged, so that stock attends exactly
the K and V it computed (transformers' offloaded cache is a ``DynamicCache`` with ``offloading``). An offloading cache
keeps what it is filled with in host memory: where its layer can take host K/V buffers as they are
(``offloaded_cache``), a block that kept its K/V in host memory (L4) fills it from them, with no device copy."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...specs import AdaptedCall
from ...registries import register_backend_probe, register_call_adapter, register_state_tensors
from .offloaded_cache import host_fill_problem, host_filler

# cache classes the graph fills after it runs -> what their first update of an empty layer does (transformers 5.x)
FILLABLE = {
    "DynamicCache": "DynamicLayer / DynamicSlidingWindowLayer keep the K/V given (offloading: then moved to the host)",
    "QuantizedCache": "QuantizedLayer quantizes the K/V given and returns them as given",
}


def _layer_attention(block: nn.Module) -> nn.Module | None:
    """The submodule that updates the cache: the one with an integer ``layer_idx``."""
    return next((m for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)


def attention_backend(block: nn.Module) -> str | None:
    if "transformers" not in sys.modules:
        return None
    attn = _layer_attention(block)
    config = getattr(attn, "config", None)
    if config is None or not type(attn).__module__.startswith("transformers."):
        return None
    return getattr(config, "_attn_implementation", None) or "eager"


def adapt_cache_call(block: nn.Module, args: tuple, kwargs: dict) -> AdaptedCall | str | None:
    if "transformers" not in sys.modules:
        return None
    from transformers.cache_utils import Cache
    caches = [v for v in (*args, *kwargs.values()) if isinstance(v, Cache)]
    if not caches:
        return None
    cache = caches[0]
    if len(caches) > 1 or type(cache).__name__ not in FILLABLE:
        return f"a {type(cache).__name__}: the graph fills an empty {' or '.join(FILLABLE)} only"
    attn = _layer_attention(block)
    config = getattr(attn, "config", None)
    if attn is None or config is None:
        return "a cache, and no attention with a layer index and config to fill it for"
    if cache.get_seq_length(attn.layer_idx) != 0:
        return "a cache that already holds tokens (the graph streams prefill into an empty cache)"
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def fill(k: torch.Tensor, v: torch.Tensor) -> None:
        cache.update(k, v, attn.layer_idx)

    offloading = bool(getattr(cache, "offloading", False))   # it keeps K/V in host memory
    host_fill, why = None, ""
    if offloading:
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        why = host_fill_problem(cache, attn.layer_idx, device) if device is not None else "no tensor gives its device"
        host_fill = host_filler(cache, attn.layer_idx) if why is None else None
    return AdaptedCall(tuple(None if a is cache else a for a in args),
                       {n: (None if v is cache else v) for n, v in kwargs.items()}, kv_heads, fill,
                       "host" if offloading else "device", host_fill, why or "")


def cache_tensors(value) -> list[torch.Tensor] | None:
    """The K/V tensors a transformers cache holds (its layers' keys and values), or None for anything else."""
    if "transformers" not in sys.modules:
        return None
    from transformers.cache_utils import Cache
    if not isinstance(value, Cache):
        return None
    return [t for layer in getattr(value, "layers", []) for t in (getattr(layer, "keys", None),
                                                                  getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)]


register_call_adapter(adapt_cache_call)
register_state_tensors(cache_tensors)
register_backend_probe(attention_backend)
