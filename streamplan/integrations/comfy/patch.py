"""``patch``: a ComfyUI ``ModelPatcher`` clone whose diffusion-model blocks stream, installed through ComfyUI's own
per-clone "dit" block replacements (``set_model_patch_replace``). Nothing is installed on the shared modules.

How a replacement reaches the block: ComfyUI's model forwards (Wan, Flux, H3, LTXV, HunyuanVideo in 0.33.0) hand each
block replacement ``{"original_block": block_wrap}``, a closure that calls the block module with the forward's own
arguments (Wan's ``context_img_len``, Flux's ``modulation_dims``, ...). The replacement runs that same function with
the closure's block module swapped for a streamed call (a new function object over the same code; the host's closure
is not touched), so the block gets exactly the arguments the host would give it, and what comes back is the host's
own output dict.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...api import BlockStreamer
from ...attention import ConsumerCaps, graph_consumer_scope
from ...execute.call_state import rehearsing
from ...options import StreamOptions
from ...plan.budget import parse_budget
from ...specs import described_whole
from .attention import OVERRIDE_KEY, ComfyAttention, override_problem
from .blocks import BlockCalls, block_calls
from .forwards import ModelCalls, ModelForward
from .memory import streamer_budget
from .weights import quantized_layers, taken, weights_problem

log = logging.getLogger("streamplan")

LEFT_TO_EXISTING = "left to an existing block replacement"
WRAPPER_KEY = "streamplan"

# "dit" block-replacement keys, and the diffusion model's block list each one indexes (ComfyUI 0.33.0: Wan and H3 use
# ``blocks``, LTXV ``transformer_blocks``, Flux and HunyuanVideo ``double_blocks`` / ``single_blocks``)
_BLOCK_LISTS = (("double_block", ("double_blocks", "blocks", "transformer_blocks")),
                ("single_block", ("single_blocks",)))

# transformer_options keys the 0.33.0 forwards set or read that change nothing inside a block's math (or that are
# checked separately below); a key outside this list may be a custom node's switch read inside the block, so the block
# stays stock, with the key named
_INFO_KEYS = frozenset({
    "cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "patches", "patches_replace", "wrappers", "callbacks",
    "prefetch_dynamic_vbars", "multigpu_thread_device", "grid_sizes", "total_blocks", "block_type", "block_index",
    "img_slice", "block", "activations_shape", "rope_options", "reference_image_num_tokens", "transformer_index",
    "original_shape",
    # MiniMax-H3's timestep shifts (ComfyUI's H3 sampling node): its forward reads them before the blocks
    "minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio",
})
# ``patches`` entries the forwards apply between blocks (outside the block call): harmless here
_MODEL_LEVEL_PATCHES = frozenset({"double_block", "single_block", "post_input", "noise_refiner", "input_block_patch",
                                  "output_block_patch"})


@dataclass
class Options:
    budget: Any = "auto"
    chunk_tokens: int | None = None
    min_tokens: int = 4096
    reserve: Any = None
    self_check: bool = False
    kv: str = "device"


@dataclass(eq=False)
class BlockState:
    """What one block of one patched clone did: its streamer (created at the first long enough call), call counts,
    and the last reason it ran stock."""

    key: tuple
    streamer: Any = None
    streamed: Any = None                                      # the module the streamer runs (the block or an adapter)
    consumer: str = ""                                        # what attended the last streamed call (report)
    module_id: int | None = None
    streamed_calls: int = 0
    stock_calls: int = 0
    short_calls: int = 0
    stock_reasons: dict[str, int] = field(default_factory=dict)
    notes: set[str] = field(default_factory=set)
    taken_bytes: int = 0                                      # cast weights the last call held beyond ComfyUI's own

    def stock(self, reason: str) -> None:
        self.stock_calls += 1
        self.stock_reasons[reason] = self.stock_reasons.get(reason, 0) + 1


@dataclass(eq=False)
class PatchState:
    """Shared by every block replacement one ``patch`` call installed; ``report`` reads it."""

    options: Options
    model_class: str
    diffusion_model: nn.Module                                # the shared model the clone runs (not changed)
    blocks: dict[tuple, BlockState] = field(default_factory=dict)
    left: dict[tuple, str] = field(default_factory=dict)     # key -> what holds it (foreign replacement)
    replaced_own: int = 0                                     # keys an earlier streamplan patch held, re-planned
    forward: ModelCalls = field(default_factory=ModelCalls)   # the DIFFUSION_MODEL wrapper's model calls
    runs: int = 0                                             # sampling runs seen (each re-plans the blocks)
    plan_options: Any = None                                  # what a forward planned ahead plans under
    # (``forward_budget``): the budget as ``streamplan.apply`` takes it
    last_sigmas: Any = None                                   # the "sigmas" tensor of the last call seen
    last_sigma: float | None = None

    def new_call(self, options: dict) -> None:
        """Per call: a call at the first sigma of a sampling run (after one at another sigma) starts a new run, and
        the blocks plan again then (``"auto"`` reads what is free at that run)."""
        sigmas = options.get("sigmas")
        if sigmas is None or sigmas is self.last_sigmas:
            return
        self.last_sigmas = sigmas
        schedule = options.get("sample_sigmas")
        try:
            sigma = float(sigmas.flatten()[0])
            first = float(schedule.flatten()[0]) if schedule is not None else None
        except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
            return
        if first is not None and abs(sigma - first) <= 1e-6 * max(1.0, abs(first)) and self.last_sigma != sigma:
            self.runs += 1
            for b in self.blocks.values():
                b.streamer, b.module_id = None, None
            self.forward.planned.clear()   # a forward planned ahead is planned again with its blocks
            self.forward.notes.clear()
        self.last_sigma = sigma


def _img(args: dict) -> Any:
    """The hidden states whose rows a block call streams: ``args["img"]``, or its first entry where the host hands a
    pair (LTX-2's (video, audio): the video rows stream, the audio rows are the block's small static side)."""
    x = args.get("img")
    return x[0] if isinstance(x, (tuple, list)) and x else x


def _rows(args: dict) -> int | None:
    x = _img(args)
    if x is None or not hasattr(x, "dim") or x.dim() < 2:
        return None
    return int(x.shape[1]) if x.dim() == 3 else int(x.shape[-2])


def _unsupported_options(options: dict, calls: BlockCalls) -> str | None:
    """Why the block cannot stream under these transformer_options (fail closed), or None."""
    if OVERRIDE_KEY in options:
        if not calls.host_attention:
            return ("an optimized_attention_override is set (a registered attention function or a node's override): "
                    "streamed only for blocks whose stock runs keep it (MiniMax-H3 today)")
        why = override_problem(options, calls.whole_attention)
        if why:
            return why
    patches = options.get("patches") or {}
    inner = sorted(k for k, v in patches.items() if v and k not in _MODEL_LEVEL_PATCHES)
    if inner:
        return f"block-level patches in transformer_options: {', '.join(inner)}"
    replace = options.get("patches_replace") or {}
    inner = sorted(k for k, v in replace.items() if v and k != "dit")
    if inner:
        return f"attention replacements in transformer_options: {', '.join(inner)}"
    unknown = sorted(str(k) for k in options if k not in _INFO_KEYS and k != OVERRIDE_KEY)
    if unknown:
        return f"transformer_options key(s) streamplan does not know: {', '.join(unknown)}"
    return None


# ComfyUI's attention for the streamed chunks: no causal masks, no grouped K/V heads (its functions take the heads of
# Q); every dtype its kernels take. Mask forms: ComfyAttention adds the additive masks ComfyUI's functions take
# (none for the streamed contract)
COMFY_CAPS = ConsumerCaps(q_offset=False, gqa=False, masks=frozenset())


class _StreamedCall:
    """Stands in for the block module inside the host's ``block_wrap``: called with the host's arguments, it runs
    the block through the clone's ``BlockStreamer`` (over what the block's class registered in ``blocks``), with the
    attention of every streamed chunk going to ComfyUI's ``optimized_attention`` under the call's
    transformer_options."""

    def __init__(self, block: BlockState, module: nn.Module, patch_state: PatchState, calls: BlockCalls):
        self.block, self.module, self.patch_state, self.calls = block, module, patch_state, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        o = self.patch_state.options
        if self.block.streamer is None or self.block.module_id != id(self.module):
            self.block.streamed = self.calls.streamed(self.module)
            self.block.streamer = BlockStreamer(
                self.block.streamed, None if o.budget is None else 1, o.chunk_tokens, self_check=o.self_check,
                kv=o.kv, name=_key_name(self.block.key))
            self.block.module_id = id(self.module)
        x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        direct = self.calls.direct_weights
        why = weights_problem(self.module, x.device, direct) if x is not None else "the call has no tensor argument"
        if why is not None:
            out = why
        else:   # each weight taken once for the call (weights.py), then the room at this call (memory.py)
            with taken(self.module, x.device, x.dtype, direct) as held:
                if held.layers:
                    self.block.notes.add(held.note())
                if not rehearsing():
                    self.block.taken_bytes = held.new_bytes
                self._budget(o, args, kwargs, x.device, held.new_bytes)
                consumer = ComfyAttention(COMFY_CAPS, kwargs.get("transformer_options") or {}, self.block.key[1],
                                          self.calls.whole_attention)
                with graph_consumer_scope(consumer):
                    out = self.calls.call(self.block.streamer, self.block.streamed, args, kwargs)
        if isinstance(out, str):
            if not rehearsing():
                self.block.stock(out)
            args, kwargs = described_whole(args, kwargs)   # tables a streamed forward described, built whole
            return self.module(*args, **kwargs)
        if not rehearsing():   # a forward's rehearsal (``forward_budget``) is not a call
            self.block.streamed_calls += 1
            self.block.consumer = consumer.phrase
        return out

    def _budget(self, o: Options, args: tuple, kwargs: dict, device: Any, taken_bytes: int) -> None:
        quantized = quantized_layers(self.module)
        if quantized:   # quantized layouts take row chunks only: no planner (which may slice features), a fixed chunk
            self.block.streamer.handle.options.budget = None
            self.block.notes.add(f"quantized weights ({len(quantized)} layer(s): {quantized[0]}, ...): row chunks "
                                 "only, at chunk_tokens or the default chunk; the budget is not planned")
        elif o.budget is not None and rehearsing():   # the whole forward's rehearsal plans it: its budget, named
            self.block.streamer.handle.options.budget = o.budget
        elif o.budget is not None:   # the room at this call, over what it holds live
            options = self.block.streamer.handle.options
            options.budget = streamer_budget(o, args, kwargs, device, taken_bytes)
            # "auto" never refuses: where ComfyUI's free memory (evictable DynamicVRAM weights not counted) holds no
            # plan, the block runs at the smallest peak it reaches (ComfyUI evicts for it, as it would for stock)
            options.smallest_when_short = o.budget == "auto"


def _key_name(key: tuple) -> str:
    return f"{key[0]}.{key[1]}"


class StreamedBlock:
    """The "dit" block replacement ``patch`` installs for one block index. ``streamplan_donates``: a model forward
    that keeps no other reference to the block's input may donate it (``forwards``)."""

    streamplan_donates = True

    def __init__(self, state: PatchState, key: tuple, list_name: str):
        self.state, self.key, self.list_name = state, key, list_name

    def __call__(self, args: dict, extra: dict) -> dict:
        original = extra["original_block"]
        block = self.state.blocks[self.key]
        self.state.new_call(args.get("transformer_options") or {})
        rows = _rows(args)
        if rows is None or rows < self.state.options.min_tokens:
            if not rehearsing():
                block.short_calls += 1
            return original(args)
        # attention masks go through: the capture streams a mask over text keys (cross-attention) and keeps a block
        # stock, naming it, when a mask spans the rows' own keys
        swapped = self._swap(original, block)
        why = swapped if isinstance(swapped, str) else None
        if why is None:
            swapped, calls = swapped
            why = _unsupported_options(args.get("transformer_options") or {}, calls)
            if why is None and _img(args).dim() != calls.img_dims:
                # the streamer's capture takes the rows from a [batch, rows, features] input and would run such a
                # call stock without a word; a family with other hidden states registers its calls (``blocks``)
                why = (f"the block's hidden states are {_img(args).dim()}-D {tuple(_img(args).shape)}, not "
                       f"[batch, rows, features], and its class registered no adapter: the capture cannot find "
                       f"the rows")
        if why is not None:
            if not rehearsing():
                block.stock(why)
            return original(args)
        return swapped(args)

    def _swap(self, original: Any, block: BlockState):
        """(``original`` with its block module replaced by the streamed call, the block's registered calls), or why
        it cannot be."""
        code, cells = getattr(original, "__code__", None), getattr(original, "__closure__", None)
        if code is None or not cells:
            return "original_block is not a closure over the block module (unknown forward)"
        found = [i for i, c in enumerate(cells) if isinstance(_cell(c), nn.Module)]
        if len(found) != 1:
            return f"original_block closes over {len(found)} modules, expected the block alone (unknown forward)"
        module = _cell(cells[found[0]])
        blocks = getattr(self.state.diffusion_model, self.list_name, None)
        if blocks is None or len(blocks) <= self.key[1] or blocks[self.key[1]] is not module:
            return f"original_block calls a module other than {self.list_name}[{self.key[1]}] (unknown forward)"
        if module.training:
            return "the block is in training mode"
        calls = block_calls(module)
        new_cells = list(cells)
        new_cells[found[0]] = types.CellType(_StreamedCall(block, module, self.state, calls))
        fn = types.FunctionType(code, original.__globals__, original.__name__, original.__defaults__,
                                tuple(new_cells))
        fn.__kwdefaults__ = original.__kwdefaults__
        return fn, calls

def _cell(c) -> Any:
    try:
        return c.cell_contents
    except ValueError:   # an empty cell
        return None


def _diffusion_model(model_patcher) -> nn.Module:
    model = model_patcher.model
    return getattr(model, "diffusion_model", model)


def block_keys(diffusion_model: nn.Module) -> list[tuple[tuple, str, nn.Module]]:
    """((block_name, index), "list[index]", module) for every block the model's forward looks up in "dit"."""
    out = []
    for block_name, lists in _BLOCK_LISTS:
        for attr in lists:
            blocks = getattr(diffusion_model, attr, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks):
                out += [((block_name, i), f"{attr}[{i}]", b) for i, b in enumerate(blocks)]
                break
    return out


def patch(model_patcher, budget: int | str | None = "auto", chunk_tokens: int | None = None, *,
          min_tokens: int = 4096, reserve: int | str | None = None, self_check: bool = False, kv: str = "device"):
    """A ``model_patcher.clone()`` whose diffusion-model blocks stream through ``BlockStreamer``.

    One "dit" block replacement per block index (``clone.set_model_patch_replace``): a call with at least ``min_tokens``
    sequence rows runs the block through a streamer (created at its first such call, kept by the clone); shorter calls,
    and calls streamplan cannot stream (block-level patches, opaque attention overrides on a block that registers no
    full-Q call: MiniMax-H3's gives one the whole Q once), run the original block, counted in the report. A block whose
    replacement another node already holds is left to it. Weights ComfyUI casts per call (lowvram offload, DynamicVRAM,
    LoRA applied per call, manual casting) are taken once per block call through comfy.ops' own cast path and held for
    its chunks (``weights``). A ``DIFFUSION_MODEL`` wrapper (``forwards``) sees every model call: a new sampling run
    re-plans the blocks, and ComfyUI 0.33.0's Wan, MiniMax-H3, Flux, HunyuanVideo, LTX-Video and LTX-2 forwards run
    streamed (input projection and head in row chunks, block inputs donated; Flux and HunyuanVideo on one joint
    text+image buffer; LTX-2's per-token tables per chunk). ``budget``: "auto" (ComfyUI's free memory less
    ``--reserve-vram`` and ``reserve``; never refuses: with too little free, the smallest reachable peak, reported),
    bytes (for the forwards streamplan runs, without ``chunk_tokens``, what the whole model call may add, planned
    before it runs, ``forward_budget``; otherwise activation room above what a block call holds at entry; cast weights
    paid from it; ``BudgetError`` below the smallest) or None (``memory``); ``chunk_tokens`` and
    ``self_check`` are ``BlockStreamer``'s; ``kv``: where a streamed block's K and V live between its phases, as
    ``streamplan.apply``'s (``"device"``: on the card, or below that floor staged to the host where ComfyUI attends
    with PyTorch SDPA; ``"host"`` forces that; ``"int8"``/``"fp8"`` compress them, approximate, named in the report).
    The input patcher and the shared modules are not changed.
    ``report(patched)`` says what happened.
    """
    if not hasattr(model_patcher, "clone") or not hasattr(model_patcher, "set_model_patch_replace"):
        raise ValueError(f"model_patcher must be a ComfyUI ModelPatcher, got {type(model_patcher).__name__}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    budget = parse_budget(budget) if isinstance(budget, str) and budget != "auto" else budget
    # the streamer checks the rest of the arguments: build one (on no module call) so bad values fail here
    BlockStreamer(nn.Identity(), budget, chunk_tokens, self_check=self_check, kv=kv,
                  **({} if reserve is None else {"reserve": reserve}))
    dm = _diffusion_model(model_patcher)
    state = PatchState(Options(budget, chunk_tokens, min_tokens, reserve, self_check, kv), type(dm).__name__, dm)
    state.plan_options = StreamOptions(budget, kv=kv)
    clone = model_patcher.clone()
    existing = (clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {}))
    for key, where, module in block_keys(dm):
        held = existing.get(key)
        if held is not None and not isinstance(held, StreamedBlock):
            state.left[key] = getattr(held, "__qualname__", type(held).__qualname__)
            continue
        if isinstance(held, StreamedBlock):
            state.replaced_own += 1
        state.blocks[key] = BlockState(key)
        clone.set_model_patch_replace(StreamedBlock(state, key, where.split("[")[0]), "dit", key[0], key[1])
    # the DIFFUSION_MODEL wrapper, in the clone's transformer_options (where its block replacements are): every model
    # call passes it, sampled or called directly; an earlier streamplan patch's wrapper gives way to this one
    from comfy import patcher_extension as ext
    wrappers = clone.model_options.setdefault("transformer_options", {}).setdefault("wrappers", {})
    wrappers.get(ext.WrappersMP.DIFFUSION_MODEL, {}).pop(WRAPPER_KEY, None)
    ext.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, ModelForward(state), clone.model_options,
                             is_model_options=True)
    if not state.blocks and not state.left:
        log.info("streamplan.integrations.comfy: %s has no block list streamplan knows; its calls run stock",
                 type(dm).__name__)
    return clone


def _states(patched) -> list[PatchState]:
    dit = patched.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    seen: list[PatchState] = []
    for fn in dit.values():
        if isinstance(fn, StreamedBlock) and all(fn.state is not s for s in seen):
            seen.append(fn.state)
    return seen


def _forward_line(st: PatchState) -> str:
    f = st.forward
    parts = []
    if f.streamed_calls:
        parts.append(f"{f.streamed_calls} call(s) streamed (input projection and output head in {f.chunk}-row "
                     f"chunks, {f.donated_blocks} block input(s) donated in the last)")
        if f.weights_once:
            parts.append(f"{f.weights_once} comfy.ops layer(s) of its row loops cast per call: weights taken once per "
                         f"loop, not per chunk")
    for why, n in f.stock_reasons.items():
        parts.append(f"{n} call(s) stock: {why}")
    parts += f.notes
    runs = f", {st.runs} sampling run(s) planned" if st.runs else ""
    return f"  model forward ({st.model_class}{runs}): " + ("; ".join(parts) if parts else "not called yet")


def report(patched) -> str:
    """Every block's story in a patched clone: streamed (with its streamer's report), stock and why, or left to
    another node's block replacement."""
    states = _states(patched)
    if not states:
        return ("streamplan.integrations.comfy: this model has no streamplan block replacements (not patched, or "
                "replaced since)")
    lines = []
    for st in states:
        o = st.options
        lines.append(f"streamplan.integrations.comfy report for {st.model_class}: {len(st.blocks)} block(s) patched, "
                     f"{len(st.left)} {LEFT_TO_EXISTING}")
        lines.append(f"  budget {o.budget!r}, chunk_tokens {o.chunk_tokens}, min_tokens {o.min_tokens}, "
                     f"reserve {o.reserve!r}, self_check {o.self_check}, kv {o.kv}")
        if st.replaced_own:
            lines.append(f"  re-planned {st.replaced_own} block(s) an earlier streamplan patch held")
        lines.append(_forward_line(st))
        for key, holder in st.left.items():
            lines.append(f"  {_key_name(key)}: {LEFT_TO_EXISTING} ({holder})")
        for key, b in st.blocks.items():
            parts = []
            if b.streamed_calls:
                parts.append(f"{b.streamed_calls} call(s) through the streamer")
                if b.consumer:
                    parts.append(b.consumer)
                entry = b.streamer.entry if b.streamer is not None else None
                if entry is None or any(n.startswith("ran stock") for n in entry.runtime_notes):
                    parts.append("which ran stock at least once (the reason is below)")
            if b.taken_bytes:
                parts.append(f"{b.taken_bytes / 2**20:.2f} MiB of cast weights held in the last call")
            if b.short_calls:
                parts.append(f"{b.short_calls} call(s) under min_tokens ran stock")
            parts += sorted(b.notes)
            for why, n in b.stock_reasons.items():
                parts.append(f"{n} call(s) stock: {why}")
            lines.append(f"  {_key_name(key)}: " + ("; ".join(parts) if parts else "not called yet"))
            if b.streamer is not None:
                lines += ["    " + line for line in b.streamer.report().splitlines()]
    return "\n".join(lines)
