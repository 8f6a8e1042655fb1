"""diffusers attention that packs its rows into a flex ``BlockMask``'s padded layout: Wan Animate 2's self-attention on
its generation steps (``kv_cache_mode="cached"``), streamed as an attention part through the flex consumer.

Its processor scatters the generation rows and the cached reference K/V into 128-aligned buffers and attends them
under the model's in-context mask. A captured block cannot take it (its rotary reads the grid's sizes off a tensor,
and the buffers' sizes are the mask's, not the rows'), so the module is taken apart here: Q, K and V of a chunk's rows
by the module's own layers, the rotary of those rows from the grid's tables as ``rope_apply`` picks them, and K/V in
the mask's layout (``specs.KVFrame``): the rows at the front, the reference keys where the processor puts them. Each Q
chunk then attends every key under the block mask cut to its query blocks (``attention.flex``). Follows diffusers
0.42.1's processor, checked by the source fingerprints below.

The block around it keeps its stock forward on those steps, its parts streamed: a call adapter
(``block_mask_refusal``) names why no captured graph can stand for it.
"""
from __future__ import annotations

import math
import sys

import torch
from torch import nn

from ...attention.flex import FlexMask, block_mask_problem, Q_BLOCK
from ...recognize.checks import call_args
from .followed import followed_spec, unfollowed
from ...registries import register_call_adapter
from ...specs import AttentionCall, AttentionSpec, KVFrame, Segment, Skip

_MODULE = "diffusers.models.transformers.transformer_wan_animate_2"
# source fingerprints (checks.source_fingerprint) of what the binder follows, as in diffusers 0.42.1
FOLLOWED = {"WanAnimate2AttnProcessor.__call__": "67a8d95bf784b054", "rope_apply": "45f2fc85b04de9eb",
            "_get_qkv_projections": "729306a55ba7e7fd"}
_ARGS = ("hidden_states", "rotary_emb", "grid_sizes", "kv_cache", "kv_cache_mode", "rope_stride",
         "reference_rotary_emb", "reference_grid_sizes", "reference_rope_stride", "attention_mask",
         "origin_latent_frames", "origin_latent_hw")


def _sources(mod) -> dict:
    """The sources the binder follows, by the names ``FOLLOWED`` records them under."""
    return {"WanAnimate2AttnProcessor.__call__": mod.WanAnimate2AttnProcessor.__call__,
             "rope_apply": mod.rope_apply, "_get_qkv_projections": mod._get_qkv_projections}


def _grid(sizes, name: str) -> tuple[int, int, int] | str:
    """The one (frames, height, width) every batch element of a [B, 3] grid tensor has, or why there is none."""
    if not isinstance(sizes, torch.Tensor) or sizes.dim() != 2 or sizes.shape[-1] != 3:
        return f"{name} is not a [batch, 3] tensor"
    rows = {tuple(int(v) for v in r) for r in sizes.tolist()}
    if len(rows) != 1:
        return f"{name} differs between batch elements"
    return next(iter(rows))


def _rope_rows(x: torch.Tensor, freqs: torch.Tensor, grid: tuple[int, int, int], stride: int, a: int) -> torch.Tensor:
    """``rope_apply`` of rows a.. of a [B, c, heads, D] tensor laid out on ``grid``: each row's table entries picked
    as ``rope_apply`` picks them for its frame, line and column, the same float64 complex product, back to float32."""
    _, h, w = grid
    B, c, n, _ = x.shape
    half = x.shape[-1] // 2
    parts = freqs.split([half - 2 * (half // 3), half // 3, half // 3], dim=1)
    r = torch.arange(a, a + c, device=freqs.device)
    table = torch.cat([parts[0][(r // (h * w)) * stride], parts[1][(r // w) % h], parts[2][r % w]], dim=-1)
    xc = torch.view_as_complex(x.to(torch.float64).reshape(B, c, n, -1, 2))
    return torch.view_as_real(xc * table.reshape(c, 1, -1)).flatten(3).float()


def _bind_wan_animate2(attn, mod, args: tuple, kwargs: dict) -> AttentionCall | str:
    from torch.nn.attention.flex_attention import BlockMask
    call = call_args(_ARGS, args, kwargs)
    if isinstance(call, str):
        return call
    if call.get("kv_cache_mode") != "cached":
        return f"kv_cache_mode={call.get('kv_cache_mode')!r} (the reference pass fills its cache: stock)"
    x, bm = call["hidden_states"], call.get("attention_mask")
    if not isinstance(bm, BlockMask):
        return f"its attention mask is {type(bm).__name__}, not a flex BlockMask"
    if getattr(attn.processor, "_parallel_config", None) is not None:
        return "under diffusers' context parallelism"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    grid, ref_grid = _grid(call.get("grid_sizes"), "grid_sizes"), _grid(call.get("reference_grid_sizes"),
                                                                         "reference_grid_sizes")
    for g in (grid, ref_grid):
        if isinstance(g, str):
            return g
    frames, origin_frames, hw = grid[0], call.get("origin_latent_frames"), call.get("origin_latent_hw")
    B, N, _ = x.shape
    if not isinstance(origin_frames, int) or not isinstance(hw, int):
        return "origin_latent_frames / origin_latent_hw are not ints"
    if frames * grid[1] * grid[2] != N:
        return f"its grid covers {frames * grid[1] * grid[2]} of its {N} rows (the rest pass through unattended)"
    if grid[1] * grid[2] != hw:
        return (f"its frames of {grid[1] * grid[2]} rows are narrower than the mask's {hw}: the rows are not "
                "contiguous in the mask's query positions")
    packed = math.ceil((origin_frames + 1) * hw / 128) * 128
    packed_ref = math.ceil(origin_frames * hw / 128) * 128
    ref_frames, ref_hw = ref_grid[0], ref_grid[1] * ref_grid[2]
    if N > packed or ref_frames * hw > packed_ref or ref_hw > hw:
        return "its rows or reference frames overflow the mask's packed layout"
    why = block_mask_problem(bm, q_len=packed, kv_len=packed + packed_ref, q_align=Q_BLOCK)
    if why:
        return why
    H = attn.heads
    D = attn.to_q.out_features // H
    freqs, stride = call["rotary_emb"], int(call.get("rope_stride") or 1)
    fused = getattr(attn, "fused_projections", False)

    def q(h, a, b):
        query = mod._get_qkv_projections(attn, h, None)[0] if fused else attn.to_q(h)
        return _rope_rows(attn.norm_q(query).unflatten(2, (H, -1)), freqs, grid, stride, a).to(x.dtype)

    def kv(h, a, b):
        if fused:
            _, key, value = mod._get_qkv_projections(attn, h, None)
        else:
            key, value = attn.to_k(h), attn.to_v(h)
        key = _rope_rows(attn.norm_k(key).unflatten(2, (H, -1)), freqs, grid, stride, a).to(x.dtype)
        return key, value.unflatten(2, (H, -1))

    def out(o, a, b):
        y = attn.to_out[0](o.flatten(2, 3).to(x.dtype))
        return attn.to_out[1](y)

    def fill(k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """The cached reference keys (their rotary as the processor applies it) and values, where it packs them."""
        key_ref, value_ref = call["kv_cache"].get()
        key_ref = mod.rope_apply(key_ref, call["reference_grid_sizes"], call["reference_rotary_emb"],
                                 call.get("reference_rope_stride") or 1).type_as(v_buf)
        at, valid = slice(packed, packed + ref_frames * hw), ref_frames * ref_hw
        k_buf[:, at].view(B, ref_frames, hw, H, D)[:, :, :ref_hw] = key_ref[:, :valid].view(B, ref_frames, ref_hw,
                                                                                             H, D)
        v_buf[:, at].view(B, ref_frames, hw, H, D)[:, :, :ref_hw] = value_ref[:, :valid].view(B, ref_frames, ref_hw,
                                                                                               H, D)

    flex = FlexMask(bm)
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=[Segment(x, q, kv, out)],
                         finish=lambda outs: outs[0], dtype=x.dtype, mask_rows=lambda a, b: flex,
                         kv_frame=KVFrame(packed + packed_ref, fill))


def recognize_flex_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    """Wan Animate 2's self-attention (its ``WanAnimate2AttnProcessor``); None for anything else."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(module) is not getattr(mod, "WanAnimate2Attention", None) or \
            type(getattr(module, "processor", None)) is not mod.WanAnimate2AttnProcessor:
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    problem = unfollowed(module, mod.WanAnimate2Attention.forward, _sources(mod), FOLLOWED)
    if problem:
        return skip(problem)
    return followed_spec(module, "diffusers WanAnimate2Attention[flex BlockMask, cached reference]", module.heads,
                         module.to_q.out_features, module.to_out[0],
                         lambda args, kwargs: _bind_wan_animate2(module, mod, args, kwargs), "flex")


# why a captured graph cannot stand for the block on a generation step (each seen tracing it with the mask taken whole)
BLOCK_MASK_REFUSAL = (
    "an argument of type BlockMask (its flex in-context mask) no captured graph can take: a captured attention "
    "attends K/V over the rows plus a fixed count of static rows, under a mask that is a tensor of the graph, while "
    "this self-attention packs its rows and the cached reference K/V into the mask's 128-aligned layout (the padding "
    "between them changes with the row count) and its rotary reads the grid's sizes off a tensor (data-dependent in "
    "a capture)")


def block_mask_refusal(block: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """A call adapter (``registries.register_call_adapter``): for Wan Animate 2's block called with a flex
    ``BlockMask`` (its generation steps), why it keeps its stock forward (its self-attention then streams as a part);
    None for any other call, which the capture takes or refuses as it does."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(block) is not getattr(mod, "WanAnimate2TransformerBlock", None):
        return None
    from torch.nn.attention.flex_attention import BlockMask
    if not any(isinstance(a, BlockMask) for a in (*args, *kwargs.values())):
        return None
    return BLOCK_MASK_REFUSAL


register_call_adapter(block_mask_refusal)
