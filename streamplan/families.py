"""Named real-width model families: what `streamplan plan`, `demo` and `bench` build, from the libraries' own classes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device, torch.dtype], tuple]
    floor_bytes_per_token: Callable[[torch.dtype], float]   # residual + K + V per token


def _wan_block(dim: int, ffn: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock
        return WanTransformerBlock(dim, ffn, heads, cross_attn_norm=True)
    return build


def _wan_inputs(dim: int, heads: int) -> Callable:
    def inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
        freqs = torch.randn(1, n, 1, dim // heads, device=dev)
        return (torch.randn(1, n, dim, device=dev, dtype=dt), torch.randn(1, 512, dim, device=dev, dtype=dt),
                torch.randn(1, 6, dim, device=dev), (freqs.cos(), freqs.sin()))
    return inputs


def _flux(single: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
        return (FluxSingleTransformerBlock if single else FluxTransformerBlock)(3072, 24, 128)
    return build


def _flux_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    freqs = torch.randn(512 + n, 128, device=dev)
    return (torch.randn(1, n, 3072, device=dev, dtype=dt), torch.randn(1, 512, 3072, device=dev, dtype=dt),
            torch.randn(1, 3072, device=dev, dtype=dt), (freqs.cos(), freqs.sin()))


def _llama_layer() -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      attn_implementation="sdpa")
    return LlamaDecoderLayer(cfg, layer_idx=0)


def _llama_inputs(n: int, dev: torch.device, dt: torch.dtype) -> tuple:
    freqs = torch.randn(1, n, 128, device=dev)
    return (torch.randn(1, n, 4096, device=dev, dtype=dt), None, None, None, False,
            (freqs.cos().to(dt), freqs.sin().to(dt)))


def _bytes(elems_per_token: int) -> Callable[[torch.dtype], float]:
    return lambda dt: elems_per_token * torch.empty((), dtype=dt).element_size()


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("wan-14b-block", "Wan2.1-14B WanTransformerBlock (diffusers): dim 5120, ffn 13824, 40 heads",
           _wan_block(5120, 13824, 40), _wan_inputs(5120, 40), _bytes(3 * 5120)),
    Family("wan-1.3b-block", "Wan2.1-1.3B WanTransformerBlock (diffusers): dim 1536, ffn 8960, 12 heads",
           _wan_block(1536, 8960, 12), _wan_inputs(1536, 12), _bytes(3 * 1536)),
    Family("flux-double-block", "Flux.1 FluxTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
           _flux(False), _flux_inputs, _bytes(3 * 3072)),
    Family("flux-single-block", "Flux.1 FluxSingleTransformerBlock (diffusers): dim 3072, 24 heads, 512 text tokens",
           _flux(True), _flux_inputs, _bytes(3 * 3072)),
    Family("llama3-8b-layer", "Llama-3-8B LlamaDecoderLayer (transformers, sdpa): 4096 hidden, 32/8 heads",
           _llama_layer, _llama_inputs, _bytes(4096 + 2 * 1024)),
]}


def on_meta(family: Family, tokens: int, dtype: torch.dtype) -> tuple[nn.Module, tuple]:
    """The family's module and inputs with no storage behind them: planning without allocating anything."""
    with torch.device("meta"):
        module = family.build().to(dtype).eval()
    inputs = family.inputs(tokens, torch.device("meta"), dtype)
    return module, inputs
