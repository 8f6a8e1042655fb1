"""ComfyUI's Flux-family blocks (``comfy.ldm.flux.layers``, also in HunyuanVideo, Chroma, Flux 2): with global
modulation (Flux 2) or Chroma's approximator the blocks are handed their modulation as dataclasses of tensors
(``ModulationOut``: shift, scale, gate; Chroma's ``ChromaModulationOut``), not as a vector. They hold per-call tensors
and nothing else, so the capture takes them as records of their fields."""
from __future__ import annotations

from ..ir import register_argument_record

register_argument_record("comfy.ldm.flux.layers:ModulationOut")
register_argument_record("comfy.ldm.chroma.layers:ChromaModulationOut")
