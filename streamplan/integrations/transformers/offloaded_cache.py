"""transformers' offloading ``DynamicCache`` (``generate(..., cache_implementation="offloaded")``) filled from K/V
rows already in host memory.

Stock prefill fills an empty layer through ``Cache.update``: the cache first starts the prefetch of the next
offloaded layer on its side stream (the two streams ordered against each other), the layer then takes the device
the K/V are computed on (``lazy_initialization``) and a device copy of them (``torch.cat`` onto an empty tensor),
and ``offload`` moves that copy to pinned host memory. A layer whose K/V a block kept in host memory (an L4 store in
one head group, pinned on CUDA) takes those buffers here instead, as views: the same prefetch, the same state left
behind (the device, host tensors of the same values, shape and dtype), no device copy and no second host copy. The
decoding steps that follow run stock and prefetch each layer to the device from these buffers.

Followed only where the functions this retraces are transformers 5.24's (``FOLLOWED``: their source fingerprints),
for a plain ``DynamicLayer`` not yet initialized, on CUDA (the cache's update orders CUDA streams); anything else
keeps the fill from device K/V, which ``Cache.update`` itself does."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...recognize.checks import source_fingerprint

# "<owner>.<function>" -> its source fingerprint in transformers 5.24.0: what ``fill_from_host`` retraces
FOLLOWED = {
    "cache.update": "4f4a4a2fe9e872f4",
    "cache.prefetch": "3be12c36c2bc1b0a",
    "cache.offload": "48909e622435233b",
    "layer.offload": "b2880132bb82c2cd",
    "layer.prefetch": "ca826fb7bae8eb7e",
    "layer.lazy_initialization": "48085e01aab9b1bd",
    "layer.update": "242da31de8dbe1e3",
}


def _layer_class(cache: Any, layer_idx: int) -> type | None:
    """The class of the cache's layer ``layer_idx``, created lazily or not yet."""
    if layer_idx < len(cache.layers):
        return type(cache.layers[layer_idx])
    return cache.layer_class_to_replicate


def host_fill_problem(cache: Any, layer_idx: int, device: torch.device) -> str | None:
    """Why this empty layer of an offloading cache cannot take host K/V buffers as they are, or None."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    if type(cache) is not DynamicCache or not getattr(cache, "offloading", False):
        return "not an offloading DynamicCache"
    if device.type != "cuda":
        return f"its update orders CUDA streams, and the layer computes on {device.type}"
    cls = _layer_class(cache, layer_idx)
    if cls is not DynamicLayer:
        return f"its layer is a {getattr(cls, '__name__', cls)}, not a DynamicLayer"
    if layer_idx < len(cache.layers) and cache.layers[layer_idx].is_initialized:
        return "its layer is already initialized"
    found = {"cache.update": type(cache).update, "cache.prefetch": type(cache).prefetch,
             "cache.offload": type(cache).offload, "layer.offload": cls.offload, "layer.prefetch": cls.prefetch,
             "layer.lazy_initialization": cls.lazy_initialization, "layer.update": cls.update}
    odd = [name for name, fn in found.items() if source_fingerprint(fn) != FOLLOWED[name]]
    if odd:
        return f"transformers' {', '.join(odd)} differ from 5.24.0's, which streamplan follows"
    return None


def host_filler(cache: Any, layer_idx: int) -> Callable[[torch.Tensor, torch.Tensor, torch.device], None]:
    """``fill(k, v, device)``: layer ``layer_idx`` of ``cache`` takes host K/V ``[B, Hkv, N, D]`` as they are, as
    ``Cache.update`` (5.24) would leave it after a prefill that computed them on ``device``."""

    def fill(k: torch.Tensor, v: torch.Tensor, device: torch.device) -> None:
        if cache.layer_class_to_replicate is not None:
            while len(cache.layers) <= layer_idx:
                cache.layers.append(cache.layer_class_to_replicate())
        # Cache.update's prelude, as it runs it: each stream waits for the other, then the next layer's prefetch
        default = torch.cuda.default_stream(device)
        default.wait_stream(cache.prefetch_stream)
        cache.prefetch_stream.wait_stream(default)
        cache.prefetch(layer_idx + 1, cache.only_non_sliding)
        # what lazy_initialization, the concatenation onto an empty tensor and offload leave in the layer
        layer = cache.layers[layer_idx]
        layer.device = device
        layer.keys, layer.values = k, v
        layer.is_initialized = True
        cache.offload(layer_idx, cache.only_non_sliding)   # host tensors: already where offload puts them

    return fill


__all__ = ["FOLLOWED", "host_fill_problem", "host_filler"]
