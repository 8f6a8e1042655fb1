"""ComfyUI's attention as a consumer of streamed Q chunks, for the blocks of a ``streamplan.integrations.comfy.patch``
clone.

Each Q chunk goes to ``comfy.ldm.modules.attention.optimized_attention`` (whatever ComfyUI selected: Sage, flash,
PyTorch, ...) with the call's ``transformer_options``, so an ``optimized_attention_override`` that ComfyUI's
``ModelPatcher.set_model_optimized_attention`` installed for a registered attention function still serves it. Those
functions attend each query row on its own, so a bounded Q chunk against the whole K and V is exact.

A K/V store's blocks (L4/L5, below the floor of K and V on the card) are attended by PyTorch's fused kernels with
their log-sum-exp (``attend_lse``: each block's partial output merged exactly), since ComfyUI's attention functions
return none. Where ComfyUI attends with PyTorch's SDPA (``attention_pytorch``, its choice on NVIDIA without Sage,
flash-attn or xformers, or set as the override) those are the kernels its chunks run on too. With another function
(Sage, flash-attn, xformers, split, sub-quadratic) a store is planned only where no plan with K and V on the card
fits the budget (``ConsumerCaps.kv_blocks_last_resort``): a budget K and V fit keeps the function the user chose, a
smaller one still runs, on PyTorch's kernels for the store's blocks, and the report says which.

Any other override is opaque (it may need every query row at once, or count calls). One that opts in to the streamed
contract (``supports_streamed_h3_qkv = True`` and ``consume(q_chunk=, global_k=, global_v=, q_start=, q_total=,
layer_index=, transformer_options=)`` returning ``q_chunk``'s shape; tensors ``[batch, heads, rows, head_dim]``) gets
the Q chunks. One that does not gets the call stock would make, once, with the whole Q (the consumer needs the whole
Q: the executor builds Q chunk by chunk into one buffer and streams the rest of the block), where the block's family
registered that call (``BlockCalls.whole_attention``: the block's one attention call as its stock forward makes it);
otherwise the block stays stock, saying so (``override_problem``).

Nothing here imports ComfyUI until a chunk is attended (or an override is judged)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

CONTRACT_FLAG = "supports_streamed_h3_qkv"
MASKS = frozenset({"additive"})
OVERRIDE_KEY = "optimized_attention_override"


def override_problem(options: dict, whole_call: Callable | None = None) -> str | None:
    """Why this call's attention override cannot be served, or None (no override, a registered attention function set
    through ComfyUI, an override that opted in to the streamed contract, or an opaque one given ``whole_call``, the
    block's stock attention call, to take once with the whole Q)."""
    override = options.get(OVERRIDE_KEY)
    if override is None or _opaque(override) is None or whole_call is not None:
        return None
    return (f"an opaque optimized_attention_override ({_name(override)}) may need every query row at once: the block "
            f"stays stock (an override opts in with {CONTRACT_FLAG} = True and consume(...); a full-Q call is made "
            f"only for blocks that register their one stock attention call: MiniMax-H3 today)")


def _name(override: Any) -> str:
    return getattr(override, "__qualname__", type(override).__qualname__)


def _opaque(override: Any) -> Any:
    """``override`` when it is opaque (neither opted in to the streamed contract nor a registered function), else
    None."""
    return None if _opted_in(override) or _registered_function(override) is not None else override


def _attends_with_sdpa(override: Any) -> bool:
    """Whether ComfyUI's chunks go to its PyTorch SDPA function (selected, or the registered override's function)."""
    import comfy.ldm.modules.attention as attention
    fn = attention.optimized_attention if override is None else _registered_function(override)
    return fn is not None and fn is attention.attention_pytorch


def _opted_in(override: Any) -> bool:
    return getattr(override, CONTRACT_FLAG, False) is True and callable(getattr(override, "consume", None))


def _registered_function(override: Any):
    """The registered attention function that ComfyUI's ``set_model_optimized_attention`` closure calls, or None."""
    import comfy.ldm.modules.attention as attention
    import comfy.model_patcher as model_patcher

    setter = getattr(model_patcher.ModelPatcher, "set_model_optimized_attention", None)
    code, cells = getattr(override, "__code__", None), getattr(override, "__closure__", None) or ()
    if setter is None or code is None or code not in setter.__code__.co_consts or len(cells) != 1:
        return None
    try:
        fn = cells[0].cell_contents
    except ValueError:
        return None
    known = list(attention.REGISTERED_ATTENTION_FUNCTIONS.values()) + [attention.optimized_attention]
    return fn if any(fn is k for k in known) else None


class ComfyAttention:
    """One block call's attention: ``attend`` takes a Q chunk ``[B, H, c, D]`` and the whole K, V ``[B, H, N, D]``
    (with an opaque override and the block's ``whole_call``: the whole Q, once)."""

    name = "comfyui"

    def __init__(self, caps, transformer_options: dict, layer_index: int, whole_call: Callable | None = None):
        self.options = transformer_options
        self.layer_index = layer_index
        override = transformer_options.get(OVERRIDE_KEY)
        self.contract = override if override is not None and _opted_in(override) else None
        self.opaque = _opaque(override) if override is not None and self.contract is None else None
        self.whole_call = whole_call if self.opaque is not None else None
        # ComfyUI's attention functions take an additive mask broadcast over [batch, heads, queries, keys] (each Q
        # chunk gets its rows of it, or the whole of a mask over the keys alone); the streamed contract and the
        # block's stock call (which passes none) take none
        plain = self.contract is None and self.whole_call is None
        self.sdpa = _attends_with_sdpa(override)
        self.caps = dataclasses.replace(caps, masks=caps.masks | MASKS if plain else frozenset(),
                                        bounded_q=self.whole_call is None, kv_blocks_lse=plain,
                                        kv_blocks_last_resort=plain and not self.sdpa)

    @property
    def phrase(self) -> str:
        """What attended the streamed call, for reports."""
        if self.whole_call is not None:
            return (f"attention in one call with the whole Q to {_name(self.opaque)}: full Q for an opaque attention "
                    f"override")
        return f"attention chunks to {self.label}"

    @property
    def label(self) -> str:
        """Who attends the chunks, for reports."""
        if self.contract is not None:
            return f"{type(self.contract).__qualname__}.consume (streamed contract)"
        override = self.options.get(OVERRIDE_KEY)
        fn = _registered_function(override) if override is not None else None
        said = f"ComfyUI optimized_attention (override: {fn.__name__})" if fn is not None else (
            "ComfyUI optimized_attention")
        if not self.caps.kv_blocks_lse:
            return said
        if self.sdpa:
            return said + "; K/V store blocks by PyTorch SDPA with their log-sum-exp"
        return said + ("; K/V store blocks, only where K/V on the card do not fit, by PyTorch SDPA with their "
                       "log-sum-exp (ComfyUI's selected function returns none)")

    def attend_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   mask: torch.Tensor | None, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One K/V block of a store, with its log-sum-exp: PyTorch SDPA's, as ComfyUI's ``attention_pytorch`` would
        attend it (whatever function ComfyUI selected: theirs return no log-sum-exp)."""
        if not self.caps.kv_blocks_lse:   # the planner offers no store without it: a bug upstream
            raise ValueError("ComfyUI's attention consumer attends K/V blocks only for Q chunks sent to ComfyUI's "
                             "attention functions (not the streamed contract's or an opaque override's)")
        from ...attention import SDPA
        return SDPA.attend_lse(q, k, v, causal=causal, mask=mask, scale=scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, causal: bool,
               mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        if causal or (mask is not None and not self.caps.masks):   # caps refuse these: a bug upstream
            raise ValueError("ComfyUI's attention consumer takes no causal attention, nor masks for the streamed "
                             "contract or an opaque override's call")
        if self.contract is not None:
            out = self.contract.consume(q_chunk=q, global_k=k, global_v=v, q_start=q_offset, q_total=k.shape[-2],
                                        layer_index=self.layer_index, transformer_options=self.options)
            if not isinstance(out, torch.Tensor) or out.shape != q.shape:
                raise ValueError(f"{type(self.contract).__qualname__}.consume returned "
                                 f"{getattr(out, 'shape', type(out).__name__)}, expected q_chunk's {tuple(q.shape)}")
            return out
        if self.whole_call is not None:
            if q_offset or q.shape[-2] != k.shape[-2]:   # the executor gives the whole Q here: a bug upstream
                raise ValueError(f"an opaque override takes the whole Q: got rows {q_offset}.. of {q.shape[-2]} "
                                 f"against {k.shape[-2]} keys")
            return self.whole_call(q, k, v, transformer_options=self.options, scale=scale)
        from comfy.ldm.modules.attention import optimized_attention
        extra = {} if scale is None else {"scale": scale}
        if mask is not None:
            extra["mask"] = mask
        return optimized_attention(q, k, v, q.shape[1], skip_reshape=True, skip_output_reshape=True,
                                   transformer_options=self.options, **extra)
