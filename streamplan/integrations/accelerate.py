"""accelerate's hooks (``accelerate.hooks.add_hook_to_module``) for ``streamplan.execute.hook_chains``: the module's own
forward is kept in ``module._old_forward`` and ``module.forward`` calls the hook around it; that attribute is the
innermost link.

``AlignDevicesHook`` (sequential CPU offload: ``enable_sequential_cpu_offload``, ``cpu_offload``) loads the module's
own weights from the offload map for its call and puts them back after: streamplan sits inside it on a block (and on
the model, whose own row loops call their leaves, each under its hook, per chunk) and runs it around the graph on the
leaves. ``SequentialHook`` (several hooks on one module: the model under sequential offload has one moving its inputs
and one loading its own weights) is taken as the chain of its hooks, each judged alone. ``CpuOffload``
(``enable_model_cpu_offload``) moves the whole model to the device before its call: streamplan sits inside it."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..execute.hook_chains import Brought, HookKind, register_chain, register_hook_kind


class AccelerateChain:
    library = "accelerate"
    module_prefix = "accelerate"

    def present(self, module: nn.Module) -> bool:
        return module.__dict__.get("_hf_hook") is not None

    def hooks(self, module: nn.Module) -> list[tuple[str, Any]] | None:
        hook = module.__dict__.get("_hf_hook")
        if hook is None or "_old_forward" not in module.__dict__ or "forward" not in module.__dict__:
            return None
        if type(hook).__name__ == "SequentialHook" and type(hook).__module__.startswith(self.module_prefix):
            return [(f"{i}", h) for i, h in enumerate(hook.hooks)]   # its pre_forwards in order, as it runs them
        return [("", hook)]

    def inner(self, module: nn.Module) -> tuple[Any, str]:
        return module, "_old_forward"

    def links(self, module: nn.Module) -> Iterable[tuple[Any, str]]:
        if "_old_forward" in module.__dict__:
            yield module, "_old_forward"


register_chain(AccelerateChain())

def _align_brings(hook: Any, module: nn.Module) -> Brought | None:
    """Offloading, the module's own weights (its submodules' too where it places them) come from the offload map to the
    execution device for its call (all of them: on the model itself they are in place before streamplan's forward
    runs, inside the hook); otherwise the hook moves inputs only."""
    if not hook.offload or hook.execution_device is None:
        return None
    tensors = list(module.parameters(recurse=hook.place_submodules))
    if hook.offload_buffers:
        tensors += list(module.buffers(recurse=hook.place_submodules))
    return Brought(id(hook), tensors, torch.device(hook.execution_device))


def _model_brings(hook: Any, module: nn.Module) -> Brought | None:
    """The whole model is moved to the execution device before its call and stays there: a first call adds it all
    (counted so: which call is first is not known inside the hook)."""
    if hook.execution_device is None:
        return None
    device = torch.device(hook.execution_device)
    return Brought(id(hook), [*module.parameters(), *module.buffers()], device)


def _align_release(hook: Any, module: nn.Module) -> None:
    """Offloading, the module's own weights back to meta if they are in place now (its after-call, as a call ends)."""
    if hook.offload and any(t.device.type != "meta" for t in module.parameters(recurse=hook.place_submodules)):
        hook.post_forward(module, None)


register_hook_kind("accelerate", "AlignDevicesHook", HookKind(around=True, weights=True, lets_go=True, rehearsed=True,
                                                              brings=_align_brings, release=_align_release))
register_hook_kind("accelerate", "CpuOffload", HookKind(around=True, lets_go=True, rehearsed=True,
                                                        brings=_model_brings))
