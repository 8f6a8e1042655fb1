"""diffusers' context parallelism (``ContextParallelConfig``, ``model.enable_parallelism``), as streamplan meets it
(diffusers 0.42.1):

- ``enable_parallelism`` sets ``processor._parallel_config`` on every attention processor; a processor that calls
  ``dispatch_attention_fn`` hands it to the backend, whose templated attention exchanges Q, K and V all-to-all over
  heads (Ulysses), rotates K/V around a ring, or both (unified). The probe here reads that configuration per block:
  Ulysses alone streams (``attention.ulysses``); ring, unified and "anything" modes keep attention stock, named.
- The model's ``_cp_plan`` becomes diffusers hooks: ``ContextParallelSplitHook`` splits named inputs (or outputs)
  of a module along the rows, ``ContextParallelGatherHook`` all-gathers a module's outputs. They are boundaries
  streamplan sits inside: a block split at its input streams on its own rows; a model forward streamplan runs itself
  (Wan) makes only its rank's rows and gathers its head's output once (``split_rows``, ``without_split``,
  ``gather_once``).
- A block is captured with its processors' configuration taken away (``detached``): the graph then holds plain SDPA
  on the rank's own rows, which streamplan feeds with the exchanged K/V and Q."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn

from ...attention.ulysses import SequenceParallel, register_parallel_probe
from ...execute.hook_chains import HookKind, register_hook_kind

SPLIT, GATHER = "ContextParallelSplitHook", "ContextParallelGatherHook"

# the cp_plan's hooks cut a module's inputs (or outputs) to the rank's rows, or all-gather its outputs: a streamed
# forward sits inside them as the stock one did, and they keep no reference to the inputs
register_hook_kind("diffusers", SPLIT, HookKind(around=True, lets_go=True))
register_hook_kind("diffusers", GATHER, HookKind(around=True, lets_go=True))


def _config(module: nn.Module) -> Any | None:
    """The ``ParallelConfig`` the attention processors inside ``module`` carry with context parallelism, or None."""
    if "diffusers" not in sys.modules:
        return None
    for m in module.modules():
        cfg = getattr(getattr(m, "processor", None), "_parallel_config", None)
        if cfg is not None and getattr(cfg, "context_parallel_config", None) is not None:
            return cfg
    return None


def model_config(model: nn.Module) -> Any | None:
    """The model's ``ContextParallelConfig`` when ``enable_parallelism`` gave it one, else None."""
    cfg = getattr(model, "_parallel_config", None)
    return getattr(cfg, "context_parallel_config", None) if cfg is not None else None


def _probe(block: nn.Module) -> SequenceParallel | None:
    cfg = _config(block)
    if cfg is None:
        return None
    cp = cfg.context_parallel_config
    if not getattr(cp, "_world_size", None) or cp._world_size <= 1:
        return None
    ring, ulysses = cp.ring_degree, cp.ulysses_degree
    mode = "unified" if ring > 1 and ulysses > 1 else "ring" if ring > 1 else "ulysses"
    label = f"diffusers context parallelism ({mode}, ring_degree={ring}, ulysses_degree={ulysses})"
    if mode != "ulysses":
        return SequenceParallel(mode, ring * ulysses, -1, None, label=label, problem=(
            f"{label}: attention runs stock (streamplan streams under Ulysses alone)"))
    if cp.ulysses_anything:
        return SequenceParallel(mode, ulysses, -1, None, label=label, problem=(
            f"{label} with ulysses_anything (uneven rows or heads): attention runs stock"))
    import torch.distributed as dist
    group = cp._ulysses_mesh.get_group()
    return SequenceParallel(mode, ulysses, dist.get_rank(group), group, label=label,
                            detach=lambda: detached(block))


register_parallel_probe(_probe)


@contextlib.contextmanager
def detached(block: nn.Module) -> Iterator[None]:
    """The block's attention processors without their parallel configuration (a capture then traces plain attention
    on the rank's own rows instead of the collectives); put back after."""
    held = []
    for m in block.modules():
        proc = getattr(m, "processor", None)
        if getattr(proc, "_parallel_config", None) is not None:
            held.append((proc, proc._parallel_config))
            proc._parallel_config = None
    try:
        yield
    finally:
        for proc, cfg in held:
            proc._parallel_config = cfg


# -- the model-level boundaries ----------------------------------------------------------------------------------
def _cp_hooks(module: nn.Module, cls: str) -> list[Any]:
    reg = module.__dict__.get("_diffusers_hook")
    if reg is None:
        return []
    return [reg.hooks[n] for n in reg._hook_order if type(reg.hooks[n]).__name__ == cls
            and type(reg.hooks[n]).__module__.startswith("diffusers.hooks")]


def only_cp_hooks(module: nn.Module) -> bool:
    """Whether the module's diffusers hooks are context parallelism's split and gather hooks and nothing else."""
    reg = module.__dict__.get("_diffusers_hook")
    names = getattr(reg, "_hook_order", None)
    return bool(names) and len(_cp_hooks(module, SPLIT) + _cp_hooks(module, GATHER)) == len(names)


def split_hook(module: nn.Module) -> Any | None:
    found = _cp_hooks(module, SPLIT)
    return found[0] if found else None


def gather_hook(module: nn.Module) -> Any | None:
    found = _cp_hooks(module, GATHER)
    return found[0] if found else None


def shard(cp: Any) -> tuple[int, int]:
    """(this rank's index, ranks) of the rows diffusers' equipartition hands out over the flattened mesh."""
    import torch.distributed as dist
    mesh = cp._flattened_mesh
    return dist.get_rank(mesh.get_group()), mesh.size()


def split_rows(rows: int, cp: Any) -> tuple[int, int] | None:
    """Rows [a, b) of ``rows`` this rank holds after a split hook (diffusers' ``tensor.chunk``), or None when they do
    not divide (diffusers' equipartition refuses that too)."""
    rank, size = shard(cp)
    if rows % size:
        return None
    n = rows // size
    return rank * n, (rank + 1) * n


@contextlib.contextmanager
def without_split(module: nn.Module) -> Iterator[None]:
    """Within this context the module's split hook passes its inputs through (the caller hands it its rank's rows
    already); its other hooks act as ever."""
    hook = split_hook(module)
    if hook is None:
        yield
        return
    ref = hook.fn_ref
    previous = ref.pre_forward
    ref.pre_forward = lambda module, *args, **kwargs: (args, kwargs)
    try:
        yield
    finally:
        ref.pre_forward = previous


@contextlib.contextmanager
def without_gather(module: nn.Module) -> Iterator[None]:
    """Within this context the module's gather hook hands back its rank's rows (a head run in row chunks gathers its
    whole output once, ``gather_once``)."""
    hook = gather_hook(module)
    if hook is None:
        yield
        return
    ref = hook.fn_ref
    previous = ref.post_forward
    ref.post_forward = lambda module, output: output
    try:
        yield
    finally:
        ref.post_forward = previous


def gather_once(module: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """What the module's gather hook makes of its whole output: every rank's rows, in rank order."""
    hook = gather_hook(module)
    return output if hook is None else hook.post_forward(module, output)
