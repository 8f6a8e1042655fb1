"""ComfyUI's Flux-family blocks (``comfy.ldm.flux.layers``, also in HunyuanVideo, Chroma, Flux 2): with global
modulation (Flux 2) or Chroma's approximator the blocks are handed their modulation as dataclasses of tensors
(``ModulationOut``: shift, scale, gate; Chroma's ``ChromaModulationOut``), not as a vector. They hold per-call tensors
and nothing else, so the capture takes them as records of their fields. The single-stream block's one attention
call, for an opaque attention override that gets the whole Q (``whole_attention``)."""
from __future__ import annotations

import torch

from ...registries import register_argument_record

register_argument_record("comfy.ldm.flux.layers:ModulationOut")
register_argument_record("comfy.ldm.chroma.layers:ChromaModulationOut")

SINGLE_BLOCK_PATH = "comfy.ldm.flux.layers.SingleStreamBlock"


def whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, transformer_options: dict,
                    scale: float | None) -> torch.Tensor:
    """The single-stream block's one attention call (``flux.math.attention`` after its rope, which the captured graph
    has applied), as ComfyUI 0.33.0 makes it, given the whole Q, K and V ``[B, H, rows, D]`` of the joint text + image
    rows: an opaque attention override sees the call the stock block makes. Returns ``[B, H, rows, D]``."""
    from comfy.ldm.modules.attention import optimized_attention
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12 * q.shape[-1] ** -0.5:
        raise ValueError(f"SingleStreamBlock attends at the default scale, the graph gives {scale}")
    b, heads, rows, dim = q.shape
    out = optimized_attention(q, k, v, heads, skip_reshape=True, mask=None, transformer_options=transformer_options)
    return out.view(b, rows, heads, dim).transpose(1, 2)
