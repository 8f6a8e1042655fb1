"""diffusers pipelines for ``streamplan.apply(pipe)``: the denoisers a pipeline calls once per step, every one of
them (Wan 2.2 A14B's high-noise ``transformer`` and low-noise ``transformer_2``, a UNet, a prior). Text encoders and
the VAE are left as they are: they run once per prompt or video, not per step, and the VAE is not row-local."""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from ...registries import register_pipeline_reader

DENOISER = re.compile(r"(transformer|unet|prior)(_\d+)?")


def denoisers(pipe: Any) -> list[tuple[str, nn.Module]] | None:
    """The pipeline's denoiser components, in its own order, or None where ``pipe`` is not a diffusers pipeline."""
    if not any(c.__module__.startswith("diffusers.") and c.__name__ == "DiffusionPipeline" for c in type(pipe).__mro__):
        return None
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return None
    return [(name, m) for name, m in components.items() if DENOISER.fullmatch(name) and isinstance(m, nn.Module)]


register_pipeline_reader(denoisers)
