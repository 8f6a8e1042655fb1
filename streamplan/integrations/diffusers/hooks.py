"""diffusers' hooks (``diffusers.hooks.HookRegistry``) for ``streamplan.execute.hook_chains``: how the chain is laid out
and what each hook class of the pinned diffusers does to a call.

A module with a registry has its forward replaced by the registry's chain; the innermost link is the first function
reference's ``original_forward`` (a hook with ``new_forward``) or ``forward``. Hook classes, by what streamplan may do:

- offload and casting (group offloading with or without streams and ``record_stream``, its lazy prefetch and execution
  tracker, layerwise casting): around a streamed forward, and around a graph on the leaves inside a block (they put
  weights in place); they keep no reference to the inputs. With ``use_stream`` the next group is onloaded on a side
  stream while this one runs and, with ``record_stream``, its weights are marked used by the compute stream: streamplan
  computes on the caller's current stream, as stock does, so both hold.
- caches that decide whether a whole block runs (first-block cache, MagCache, SeaCache, TaylorSeer on blocks): around
  a streamed block, which streams when the cache lets it run. They keep the block's input (to take a residual), so
  that input is not donated; TaylorSeer keeps the output (its order-0 factor is the output itself when the dtypes
  match), so the next block is not given it to overwrite.
- caches and guidance hooks on parts inside a block (pyramid attention broadcast, FasterCache's attention hook,
  TaylorSeer on attentions, layer skip, text K/V cache): known, and the block stays stock with the reason. A captured
  graph fuses the attention with the rest of the block, so a hook that replaces an attention's output by one kept from
  an earlier step (or skips it) cannot act inside it; streaming it would mean cutting the graph at that attention and
  keeping the whole [rows, inner] attention output, which is what streaming avoids.
- model-level hooks that wrap the whole transformer call (FasterCache's denoiser hook, SeaCache's root hook, the text
  K/V cache's transformer hook, the cache hooks' state holders): around a streamed model forward."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ...execute.hook_chains import Brought, HookKind, register_chain, register_hook_kind, same_device


class DiffusersChain:
    library = "diffusers"
    module_prefix = "diffusers.hooks"

    @staticmethod
    def _registry(module: nn.Module) -> Any | None:
        return module.__dict__.get("_diffusers_hook")

    def present(self, module: nn.Module) -> bool:
        reg = self._registry(module)
        return bool(getattr(reg, "_hook_order", None))

    def hooks(self, module: nn.Module) -> list[tuple[str, Any]] | None:
        reg = self._registry(module)
        if reg is None or not getattr(reg, "_fn_refs", None) or "forward" not in module.__dict__:
            return None
        return [(name, reg.hooks[name]) for name in reversed(reg._hook_order)]

    def inner(self, module: nn.Module) -> tuple[Any, str]:
        ref = self._registry(module)._fn_refs[0]
        return ref, ("original_forward" if ref.original_forward is not None else "forward")

    def links(self, module: nn.Module) -> Iterable[tuple[Any, str]]:
        reg = self._registry(module)
        for ref in getattr(reg, "_fn_refs", ()) or ():
            yield ref, "original_forward"
            yield ref, "forward"


register_chain(DiffusersChain())

def _group_brings(hook: Any, module: nn.Module) -> Brought | None:
    """A group's modules' tensors and its own, all of them (the model's own group is onloaded before streamplan's
    forward runs, inside its hooks, and offloaded after: the call adds it); with a stream the next group is onloaded
    while this one runs. Nothing where the group is offloaded to where it runs."""
    group = hook.group
    device = torch.device(group.onload_device)
    if same_device(group.offload_device, device):
        return None
    tensors = [t for m in group.modules for t in (*m.parameters(), *m.buffers())]
    tensors = list({id(t): t for t in [*tensors, *group.parameters, *group.buffers]}.values())
    return Brought(id(group), tensors, device, ahead=group.stream is not None)


def _group_release(hook: Any, module: nn.Module) -> None:
    """A group onloaded now (the model's own, a prefetched one) offloaded again, once, by its offload leader; its
    side stream finished first (a prefetch may still be copying)."""
    group = hook.group
    if group.offload_leader is not module or same_device(group.offload_device, group.onload_device):
        return
    tensors = [t for m in group.modules for t in m.parameters()] + list(group.parameters)
    if not any(same_device(t.device, group.onload_device) for t in tensors):
        return
    if group.stream is not None:
        group.stream.synchronize()
    group.offload_()


def _cast_brings(hook: Any, module: nn.Module) -> Brought:
    """The module's floating tensors, cast to the compute dtype for its call (``module.to``: all of them)."""
    tensors = [t for t in (*module.parameters(), *module.buffers())
               if t.is_floating_point() and t.dtype != hook.compute_dtype]
    device = next((t.device for t in tensors), torch.device("cpu"))
    return Brought(id(hook), tensors, device, dtype=hook.compute_dtype)


_WEIGHTS = HookKind(around=True, weights=True, lets_go=True, rehearsed=True)
register_hook_kind("diffusers", "GroupOffloadingHook", HookKind(around=True, weights=True, lets_go=True,
                                                                rehearsed=True, brings=_group_brings,
                                                                release=_group_release))
register_hook_kind("diffusers", "LayerwiseCastingHook", HookKind(around=True, weights=True, lets_go=True,
                                                                 rehearsed=True, brings=_cast_brings))
register_hook_kind("diffusers", "LayerExecutionTrackerHook", _WEIGHTS)
# on the model: onloads its own group and, after the first call, wires the prefetch order of the groups
register_hook_kind("diffusers", "LazyPrefetchGroupOffloadingHook", HookKind(around=True, lets_go=True, rehearsed=True))
# peft's input autocast is turned off around the call (layerwise casting with LoRA): values untouched
register_hook_kind("diffusers", "PeftInputAutocastDisableHook", HookKind(around=True, lets_go=True))

# caches that decide whether a whole block runs: the block streams when it runs; they keep its input (a residual)
_BLOCK_CACHE = HookKind(around=True)
# the first-block cache's head keeps its block's output too (the tail's residual is taken against it)
register_hook_kind("diffusers", "FBCHeadBlockHook", HookKind(around=True, keeps_output=True))
for _name in ("FBCBlockHook", "MagCacheHeadHook", "MagCacheBlockHook", "SeaCacheLeaderBlockHook",
              "SeaCacheBlockHook"):
    register_hook_kind("diffusers", _name, _BLOCK_CACHE)
# TaylorSeer on a block: computes it or predicts from kept outputs (its order-0 factor can be the output itself)
register_hook_kind("diffusers", "TaylorSeerCacheHook", HookKind(around=True, lets_go=True, keeps_output=True))

# around the whole transformer call: they read or split its inputs and rework its output, keeping no input
for _name in ("FasterCacheDenoiserHook", "SeaCacheRootHook", "TextKVCacheTransformerHook"):
    register_hook_kind("diffusers", _name, HookKind(around=True, lets_go=True))

_FUSED = ("a captured graph fuses the attention with the rest of the block, so the hook's reuse of an earlier "
          "step's attention output cannot act inside it (streaming it would keep that whole attention output)")
register_hook_kind("diffusers", "PyramidAttentionBroadcastHook", HookKind(keeps_output=True, stock=(
    f"pyramid attention broadcast reuses attention outputs across steps; {_FUSED}")))
register_hook_kind("diffusers", "FasterCacheBlockHook", HookKind(keeps_output=True, stock=(
    f"FasterCache extrapolates attention outputs from earlier steps; {_FUSED}")))
register_hook_kind("diffusers", "SeaCachePostNormHook", HookKind(keeps_output=True, stock=(
    "SeaCache's post-norm boundary (Cosmos 3) replaces a norm's output inside the model")))
register_hook_kind("diffusers", "TextKVCacheBlockHook", HookKind(stock=(
    "the text K/V cache hands the block cached text keys and values through attention_kwargs, which a captured "
    "graph of the block does not take")))
_SKIP = ("layer skip replaces parts of the block's computation under its own conditions, which a captured graph "
         "would not follow")
for _name in ("AttentionProcessorSkipHook", "FeedForwardSkipHook", "TransformerBlockSkipHook",
              "SmoothedEnergyGuidanceHook"):
    register_hook_kind("diffusers", _name, HookKind(stock=_SKIP))
