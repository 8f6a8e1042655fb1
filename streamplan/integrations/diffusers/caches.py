"""diffusers' per-layer K/V caches that its blocks read on their cached steps, declared so the capture takes them as
their tensors (``graph.cache_views``): GLM-Image's condition-image cache ("read", "skip" or no mode), Qwen-Image
2.1's text prefix (``kv_cache_mode="cached"``), the Sana-WM refiner's sink and history (``"inject"``), Wan Animate
2's reference K/V (``"cached"``). Their filling steps ("write", "extract", "store") set the cache inside the block:
those calls keep their stock forward, named."""
from __future__ import annotations

from ...registries import register_read_cache

_T = "diffusers.models.transformers."
for _path in ("transformer_glm_image:GlmImageLayerKVCache", "transformer_qwenimage21:QwenImage21KVLayerCache",
              "transformer_sana_wm_refiner:SanaWMRefinerKVLayerCache",
              "transformer_wan_animate_2:WanAnimate2KVLayerCache"):
    register_read_cache(_T + _path)
