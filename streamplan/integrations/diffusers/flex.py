"""diffusers attention that packs its rows into a flex ``BlockMask``'s padded layout: Wan Animate 2's self-attention on
its generation steps (``kv_cache_mode="cached"``), and the block around it.

Its processor scatters the generation rows and the cached reference K/V into 128-aligned buffers and attends them
under the model's in-context mask. Two ways streamplan takes it, both following diffusers 0.42.1's sources (checked by
the source fingerprints below):

- **The block, from its captured graph.** A call describer (``describe_generation_step``) hands the capture the grids'
  sizes as ints and takes the ``BlockMask`` out as a described mask (``specs.RowMask.flex``); while the block is
  traced, a stand-in processor gives K and V over the rows, then the reference keys packed as the processor packs
  them, then one zero key, attended with no mask of the graph's own. The described mask is the model's own
  ``mask_mod`` read at each key's packed index, its block tables mapped from the model's; the zero key stands for the
  padding keys after the rows that the model's mask lets every query row see (their log count added to its score:
  the same softmax weight, no value). The executor cuts it to each Q chunk through the flex consumer.
- **The attention as a part** (the block stock, or the attention streamed alone): Q, K and V of a chunk's rows by the
  module's own layers, the rotary of those rows from the grid's tables as ``rope_apply`` picks them, and K/V in the
  mask's layout (``specs.KVFrame``): the rows at the front, the reference keys where the processor puts them. Each Q
  chunk then attends every key under the block mask cut to its query blocks (``attention.flex``).
"""
from __future__ import annotations

import contextlib
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.flex import FlexMask, block_mask_problem, Q_BLOCK
from ...recognize.checks import call_args, source_fingerprint
from .followed import FOLLOWED_VERSION, followed_spec, processor_call, unfollowed
from ...registries import register_backend_probe, register_call_describer, register_capture_context
from ...specs import AttentionCall, AttentionSpec, KVFrame, RowMask, Segment, Skip

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


def _rope_at(x: torch.Tensor, freqs: torch.Tensor, r: torch.Tensor, h: int, w: int, stride: int) -> torch.Tensor:
    """``rope_apply`` of the rows ``r`` (their indices) of a [B, c, heads, D] tensor laid out on frames of h x w rows:
    each row's table entries picked as ``rope_apply`` picks them for its frame, line and column, the same float64
    complex product, back to float32."""
    B, c, n, _ = x.shape
    half = x.shape[-1] // 2
    parts = freqs.split([half - 2 * (half // 3), half // 3, half // 3], dim=1)
    table = torch.cat([parts[0][(r // (h * w)) * stride], parts[1][(r // w) % h], parts[2][r % w]], dim=-1)
    xc = torch.view_as_complex(x.to(torch.float64).reshape(B, c, n, -1, 2))
    return torch.view_as_real(xc * table.reshape(c, 1, -1)).flatten(3).float()


@dataclass(frozen=True)
class _Layout:
    """Where a generation step's processor packs its rows and the cached reference keys (``[generation |
    reference]``, each 128-aligned, the mask's layout)."""

    grid: tuple[int, int, int]
    ref_grid: tuple[int, int, int]
    hw: int              # rows a frame of the full video has in the mask (``origin_latent_hw``)
    packed: int          # the generation segment's keys, padded (the reference keys start here)
    packed_ref: int

    @property
    def ref_frames(self) -> int:
        return self.ref_grid[0]

    @property
    def ref_hw(self) -> int:
        return self.ref_grid[1] * self.ref_grid[2]


def _layout(call: dict, rows: int) -> _Layout | str:
    """A cached step's packing (the checks under which a chunk of rows lands where the processor puts it), or why
    its rows cannot be streamed."""
    grid, ref_grid = _grid(call.get("grid_sizes"), "grid_sizes"), _grid(call.get("reference_grid_sizes"),
                                                                         "reference_grid_sizes")
    for g in (grid, ref_grid):
        if isinstance(g, str):
            return g
    origin_frames, hw = call.get("origin_latent_frames"), call.get("origin_latent_hw")
    if not isinstance(origin_frames, int) or not isinstance(hw, int):
        return "origin_latent_frames / origin_latent_hw are not ints"
    if grid[0] * grid[1] * grid[2] != rows:
        return f"its grid covers {grid[0] * grid[1] * grid[2]} of its {rows} rows (the rest pass through unattended)"
    if grid[1] * grid[2] != hw:
        return (f"its frames of {grid[1] * grid[2]} rows are narrower than the mask's {hw}: the rows are not "
                "contiguous in the mask's query positions")
    lay = _Layout(grid, ref_grid, hw, math.ceil((origin_frames + 1) * hw / 128) * 128,
                  math.ceil(origin_frames * hw / 128) * 128)
    if rows > lay.packed or lay.ref_frames * hw > lay.packed_ref or lay.ref_hw > hw:
        return "its rows or reference frames overflow the mask's packed layout"
    return lay


def _generation_step(call: dict) -> tuple[torch.Tensor, object, _Layout] | str:
    """A generation step's rows, its ``BlockMask`` and packing, as the part's binder and the block's describer both
    take them; or why the call cannot be streamed."""
    from torch.nn.attention.flex_attention import BlockMask
    if call.get("kv_cache_mode") != "cached":
        return f"kv_cache_mode={call.get('kv_cache_mode')!r} (the reference pass fills its cache: stock)"
    x, bm = call["hidden_states"], call.get("attention_mask")
    if not isinstance(bm, BlockMask):
        return f"its attention mask is {type(bm).__name__}, not a flex BlockMask"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    lay = _layout(call, x.shape[1])
    if isinstance(lay, str):
        return lay
    why = block_mask_problem(bm, q_len=lay.packed, kv_len=lay.packed + lay.packed_ref, q_align=Q_BLOCK)
    return why or (x, bm, lay)


def _bind_wan_animate2(attn, mod, args: tuple, kwargs: dict) -> AttentionCall | str:
    call = processor_call(_ARGS, attn.processor, args, kwargs)
    if isinstance(call, str):
        return call
    step = _generation_step(call)
    if isinstance(step, str):
        return step
    x, bm, lay = step
    B = x.shape[0]
    H = attn.heads
    D = attn.to_q.out_features // H
    h, w = lay.grid[1], lay.grid[2]
    freqs, stride = call["rotary_emb"], int(call.get("rope_stride") or 1)
    fused = getattr(attn, "fused_projections", False)

    def q(x_, a, b):
        query = mod._get_qkv_projections(attn, x_, None)[0] if fused else attn.to_q(x_)
        r = torch.arange(a, b, device=freqs.device)
        return _rope_at(attn.norm_q(query).unflatten(2, (H, -1)), freqs, r, h, w, stride).to(x.dtype)

    def kv(x_, a, b):
        if fused:
            _, key, value = mod._get_qkv_projections(attn, x_, None)
        else:
            key, value = attn.to_k(x_), attn.to_v(x_)
        r = torch.arange(a, b, device=freqs.device)
        key = _rope_at(attn.norm_k(key).unflatten(2, (H, -1)), freqs, r, h, w, stride).to(x.dtype)
        return key, value.unflatten(2, (H, -1))

    def out(o, a, b):
        y = attn.to_out[0](o.flatten(2, 3).to(x.dtype))
        return attn.to_out[1](y)

    def fill(k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """The cached reference keys (their rotary as the processor applies it) and values, where it packs them."""
        key_ref, value_ref = call["kv_cache"].get()
        key_ref = mod.rope_apply(key_ref, call["reference_grid_sizes"], call["reference_rotary_emb"],
                                 call.get("reference_rope_stride") or 1).type_as(v_buf)
        ref_frames, ref_hw, hw = lay.ref_frames, lay.ref_hw, lay.hw
        at, valid = slice(lay.packed, lay.packed + ref_frames * hw), ref_frames * ref_hw
        k_buf[:, at].view(B, ref_frames, hw, H, D)[:, :, :ref_hw] = key_ref[:, :valid].view(B, ref_frames, ref_hw,
                                                                                             H, D)
        v_buf[:, at].view(B, ref_frames, hw, H, D)[:, :, :ref_hw] = value_ref[:, :valid].view(B, ref_frames, ref_hw,
                                                                                               H, D)

    flex = FlexMask(bm)
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=[Segment(x, q, kv, out)],
                         finish=lambda outs: outs[0], dtype=x.dtype, mask_rows=lambda a, b: flex,
                         kv_frame=KVFrame(lay.packed + lay.packed_ref, fill))


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


# -- the block captured whole, its mask described ----------------------------------------------------------------
# what the block's describer follows besides the processor: the model's mask logic, whose rule for the padding keys
# after the generation rows (every query row attends the q_limit - rows of them) the sink key stands for
BLOCK_FOLLOWED = {"WanAnimate2Transformer3DModel.create_mask": "36443568f38f9344"}
_BLOCK_ARGS = ("hidden_states", "temb", "encoder_hidden_states", "kv_cache", "kv_cache_mode", "rotary_emb",
               "grid_sizes", "encoder_hidden_states_image", "reference_rotary_emb", "reference_grid_sizes",
               "attention_mask", "origin_latent_frames", "origin_latent_hw")
_MASK_LOGIC = "WanAnimate2Transformer3DModel.create_mask.<locals>.attention_mask_logic"
_COMPACT: dict[int, tuple] = {}   # id of a model's BlockMask -> (a weak reference to it, layout key, FlexMask, bytes)


def _block_problem(block: nn.Module, mod) -> str | None:
    """Why the block's self-attention may not be traced through the stand-in (None: it may)."""
    attn = getattr(block, "self_attn", None)
    if type(getattr(attn, "processor", None)) is not mod.WanAnimate2AttnProcessor:
        return "its self-attention's processor is not the WanAnimate2AttnProcessor streamplan follows"
    if getattr(attn.processor, "_parallel_config", None) is not None:
        return "under diffusers' context parallelism"
    sources = {**_sources(mod), "WanAnimate2Transformer3DModel.create_mask":
               mod.WanAnimate2Transformer3DModel.create_mask}   # (the block's own checks see hooks and patches)
    followed = {**FOLLOWED, **BLOCK_FOLLOWED}
    changed = [name for name, fn in sources.items() if source_fingerprint(fn) != followed[name]]
    if changed:
        return f"{', '.join(changed)} differ from the diffusers {FOLLOWED_VERSION} source streamplan follows"
    return None


def _mask_limits(bm) -> dict | str:
    """The values the model's mask logic closes over (hw, q_limit, q_total, k_limit), or why the mask is not the
    model's own."""
    fn = bm.mask_mod
    if getattr(fn, "__qualname__", "") != _MASK_LOGIC or fn.__closure__ is None:
        return "its BlockMask is not the one WanAnimate2Transformer3DModel.create_mask makes"
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__)}


def _dense(num, idx, q_blocks: int) -> torch.Tensor:
    """The key blocks each of the first ``q_blocks`` query blocks lists (a [.., q_blocks, kv_blocks] bool)."""
    idx = idx[..., :q_blocks, :].long()
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., :q_blocks, None]
    return torch.zeros(idx.shape, dtype=torch.int32, device=idx.device).scatter_add_(-1, idx, listed.int()) > 0


def _tables(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [.., q_blocks, kv_blocks] bool as BlockMask tables: per query block the count, then the indices first."""
    num = blocks.sum(-1, dtype=torch.int32)
    return num, torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)


def _compact_mask(bm, lay: _Layout, rows: int, limits: dict) -> tuple[FlexMask, int]:
    """The model's mask over the graph's keys: the rows, the packed reference keys (zeros where the processor leaves
    them), then one zero key standing for the ``q_limit - rows`` padding keys every query row attends after the rows
    (its score plus their log count: exp of it is their softmax weight, and their values are zeros). Each key's
    verdict is the model's own ``mask_mod`` at the key's packed index; a key block is visited where any packed block
    it maps to is (partial), full only where a block of the rows alone is full. With its tables' bytes."""
    from torch.nn.attention.flex_attention import BlockMask
    padding = limits["q_limit"] - rows
    key = (rows, lay, padding)
    held = _COMPACT.get(id(bm))
    if held is not None and held[0]() is bm and held[1] == key:
        return held[2], held[3]
    qb, kb = bm.BLOCK_SIZE
    packed, sink = lay.packed, rows + lay.packed_ref
    keys, q_blocks = sink + 1, -(-rows // qb)
    full = (_dense(bm.full_kv_num_blocks, bm.full_kv_indices, q_blocks) if bm.full_kv_num_blocks is not None
            else torch.zeros((*bm.kv_indices.shape[:-2], q_blocks, bm.kv_indices.shape[-1]), dtype=torch.bool,
                             device=bm.kv_indices.device))
    visited = _dense(bm.kv_num_blocks, bm.kv_indices, q_blocks) | full
    kv_blocks = -(-keys // kb)
    at = torch.arange(sink, device=visited.device)
    packed_at = torch.where(at < rows, at, at - rows + packed)   # each graph key's packed index (the sink's: none)
    maps = torch.zeros(visited.shape[-1], kv_blocks, device=visited.device)
    maps[packed_at // kb, at // kb] = 1.0
    blocks = (visited.float() @ maps) > 0
    if padding > 0:
        blocks[..., sink // kb] = True
    whole = torch.zeros_like(blocks)
    whole[..., :rows // kb] = full[..., :rows // kb]
    given, log_count = bm.mask_mod, math.log(padding) if padding > 0 else 0.0

    def mask_mod(b, h, q, kv):
        ref = (kv >= rows) & (kv < sink)
        seen = given(b, h, q, torch.where(ref, kv - rows + packed, kv)) & (kv < sink)
        return seen | (kv == sink) if padding > 0 else seen

    def score_mod(score, b, h, q, kv):
        return torch.where(kv == sink, score + log_count, score)

    compact = BlockMask.from_kv_blocks(*_tables(blocks & ~whole), *_tables(whole), BLOCK_SIZE=(qb, kb),
                                       mask_mod=mask_mod, seq_lengths=(rows, keys))
    # the partial and full tables, and the transposed pair of each torch derives
    nbytes = 4 * 4 * blocks.numel()
    mask = FlexMask(compact, score_mod if padding > 0 else None)
    _COMPACT[id(bm)] = (weakref.ref(bm, lambda _, i=id(bm): _COMPACT.pop(i, None)), key, mask, nbytes)
    return mask, nbytes


def describe_generation_step(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | str | None:
    """A call describer (``registries.register_call_describer``): Wan Animate 2's block on a generation step (a flex
    ``BlockMask``), as its captured graph takes it: the mask described over the rows and the reference keys
    (``_compact_mask``, a ``RowMask`` the executor cuts to each Q chunk), the grids' sizes as ints the trace bakes in
    (the stand-in processor below reads them). None for any other call; a reason where it must run stock."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(block) is not getattr(mod, "WanAnimate2TransformerBlock", None):
        return None
    from torch.nn.attention.flex_attention import BlockMask
    if not any(isinstance(a, BlockMask) for a in (*args, *kwargs.values())):
        return None
    why = _block_problem(block, mod)
    if why:
        return why
    call = call_args(_BLOCK_ARGS, args, kwargs)
    if isinstance(call, str):
        return call
    step = _generation_step(call)
    if isinstance(step, str):
        return step
    x, bm, lay = step
    B, N, _ = x.shape
    limits = _mask_limits(bm)
    if isinstance(limits, str):
        return limits
    origin = call["origin_latent_frames"]
    if limits != {"hw": lay.hw, "q_limit": (origin + 1) * lay.hw, "q_total": lay.packed, "k_limit": origin * lay.hw}:
        return "its BlockMask was made for another video than the call's origin_latent_frames / origin_latent_hw"
    if N > limits["q_limit"]:
        return f"its {N} rows pass the mask's {limits['q_limit']} valid query rows"
    key_ref = getattr(call["kv_cache"], "key", None)
    if not isinstance(key_ref, torch.Tensor) or key_ref.shape[1] < lay.ref_frames * lay.ref_hw:
        return "its cache holds fewer reference keys than its reference grid"
    flex, nbytes = _compact_mask(bm, lay, N, limits)
    row_mask = RowMask(B, N, N + lay.packed_ref + 1, None, None, lambda: bm, flex=flex, flex_bytes=nbytes)
    swap = {id(bm): row_mask, id(call["grid_sizes"]): lay.grid[1:], id(call["reference_grid_sizes"]): lay.ref_grid}
    return (tuple(swap.get(id(a), a) for a in args), {k: swap.get(id(v), v) for k, v in kwargs.items()})


def _traced_generation_step(processor, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode,
                            rope_stride=1, reference_rotary_emb=None, reference_grid_sizes=None,
                            reference_rope_stride=1, attention_mask=None, origin_latent_frames=None,
                            origin_latent_hw=None):
    """Stands in for the processor while a described generation step is traced: the same projections, rotary (by
    each row's index) and output, with K and V over the rows, then the reference keys packed as the processor packs
    them, then one zero key (``_compact_mask``'s sink), attended with no mask of the graph's own: the call's described
    mask is its rule. Any other call (the reference pass, a grid left a tensor) goes to the processor itself."""
    mod = sys.modules[_MODULE]
    if kv_cache_mode != "cached" or not isinstance(grid_sizes, tuple):
        return _PROCESSOR_CALL(processor, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode,
                               rope_stride, reference_rotary_emb, reference_grid_sizes, reference_rope_stride,
                               attention_mask, origin_latent_frames, origin_latent_hw)
    query, key, value = mod._get_qkv_projections(attn, hidden_states, None)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
    B, N, H, D = query.shape
    (h, w), (ref_frames, ref_h, ref_w) = grid_sizes, reference_grid_sizes
    r = torch.arange(N, device=query.device)
    query = _rope_at(query, rotary_emb, r, h, w, rope_stride).to(value.dtype)
    key = _rope_at(key, rotary_emb, r, h, w, rope_stride).to(value.dtype)
    ref_hw, valid = ref_h * ref_w, ref_frames * ref_h * ref_w
    key_ref, value_ref = kv_cache.get()
    key_ref = _rope_at(key_ref[:, :valid], reference_rotary_emb, torch.arange(valid, device=query.device), ref_h,
                       ref_w, reference_rope_stride).to(value.dtype)
    packed_ref = math.ceil(origin_latent_frames * origin_latent_hw / 128) * 128

    def packed(t: torch.Tensor) -> torch.Tensor:   # each reference frame in a frame of hw rows, then the padding
        t = F.pad(t[:, :valid].reshape(B, ref_frames, ref_hw, H, D), (0, 0, 0, 0, 0, origin_latent_hw - ref_hw))
        return F.pad(t.reshape(B, ref_frames * origin_latent_hw, H, D),
                     (0, 0, 0, 0, 0, packed_ref - ref_frames * origin_latent_hw))

    sink = torch.zeros(B, 1, H, D, dtype=value.dtype, device=value.device)
    keys = torch.cat([key, packed(key_ref), sink], 1).transpose(1, 2)
    values = torch.cat([value, packed(value_ref.to(value.dtype)), sink], 1).transpose(1, 2)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values).transpose(1, 2)
    return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(query.dtype)))


_PROCESSOR_CALL = None   # the processor's own __call__, while the stand-in replaces it


@contextlib.contextmanager
def _stand_in(mod) -> Iterator[None]:
    global _PROCESSOR_CALL
    cls = mod.WanAnimate2AttnProcessor
    if cls.__call__ is _traced_generation_step:   # already standing in (a trace inside a trace)
        yield
        return
    _PROCESSOR_CALL = cls.__call__
    cls.__call__ = _traced_generation_step
    try:
        yield
    finally:
        cls.__call__ = _PROCESSOR_CALL


def _while_traced(block: nn.Module):
    """The stand-in processor while a Wan Animate 2 block whose sources streamplan follows is traced."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(block) is not getattr(mod, "WanAnimate2TransformerBlock", None) or \
            _block_problem(block, mod):
        return None
    return _stand_in(mod)


def _in_context_backend(block: nn.Module) -> str | None:
    """Its self-attention dispatches to flex on generation steps, whatever the active backend."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(block) is not getattr(mod, "WanAnimate2TransformerBlock", None):
        return None
    return "flex"


register_call_describer(describe_generation_step)
register_capture_context(_while_traced)
register_backend_probe(_in_context_backend)
