"""Weights as ComfyUI holds them, for a streamed block call.

``comfy.ops`` layers take their weights at every call (``cast_bias_weight``): a device move (lowvram offload), a
dtype change (manual casting), the per-call patches ComfyUI puts in ``weight_function`` / ``bias_function`` (LoRA
under lowvram, weight wrappers) and, under DynamicVRAM (comfy-aimdo), a fault of the layer's weights into its VBAR.
A streamed block runs its layers once per row chunk, so the layers' own path would take every weight once per chunk.

``taken(block, device, dtype)`` takes each weight once per block call through ComfyUI's own path instead and holds it
for the call's chunk loops: under DynamicVRAM the block's layers are prefetched together by ComfyUI's own prefetch
(``comfy.model_prefetch``, as the MiniMax-H3 forward prefetches a block; where the host already did, its prefetch is
used), then every layer's weights go through ``comfy.ops.cast_bias_weight``. For the call the layer is a plain layer
over those tensors (``comfy_cast_weights`` off, no functions, its parameters the taken tensors), so the block's
capture and plans see plain layers and never a per-call patch; at exit the layer's own attributes and parameters are
put back and ComfyUI's ``uncast_bias_weight`` / prefetch cleanup release what was taken.

Only layers whose cast path streamplan read (``comfy.ops.disable_weight_init``'s Linear, Conv1d/2d, LayerNorm,
GroupNorm, RMSNorm and the ``manual_cast`` classes that inherit them) with plain tensor weights are taken. Any other
layer (quantized layouts, fp8 or custom-node ops such as GGUF) is traced as its forward runs where that holds (its
weights on the device, no per-call patches); with per-call patches or weights off the device it keeps the block stock,
named by ``weights_problem``. Quantized layouts stream in row chunks only (``quantized_layers``).

One assumption: ComfyUI runs a model's calls one at a time (the shared modules hold the taken weights for the call).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

# the comfy.ops classes whose forward and cast path were read: with the weights cast_bias_weight returns, their
# stock forward (torch.nn's) is their cast forward
_KNOWN = ("Linear", "Conv1d", "Conv2d", "LayerNorm", "GroupNorm", "RMSNorm")
# the model forwards' row loops also take Conv3d patch embeddings (a call with ``autopad``, which a plain Conv3d would
# not take, keeps its own cast; blocks keep Conv3d out)
_ROW_KNOWN = _KNOWN + ("Conv3d",)
_SWITCHES = ("comfy_cast_weights", "weight_function", "bias_function")
# ModelPatcher's per-layer bookkeeping, read only by the cast path: hidden while a layer is plain, so the capture (keyed
# by the layers' plain attributes) is shared by every block of a class (ModelPatcherDynamic's seed_key is the layer's
# own name and its LoRA sits in *_lowvram_function on the patched layers only; lowvram marks some layers, not others)
_BOOKKEEPING = ("prev_comfy_cast_weights", "comfy_patched_weights", "comfy_force_cast_weights", "seed_key",
                "weight_lowvram_function", "bias_lowvram_function")
_ABSENT = object()


def _known_classes(names: tuple[str, ...] = _KNOWN) -> tuple[type, ...]:
    import comfy.ops
    return tuple(getattr(comfy.ops.disable_weight_init, name) for name in names)


def _is_known(m: nn.Module, known: tuple[type, ...]) -> bool:
    cls = type(m)
    return any(cls.forward is k.forward and cls.forward_comfy_cast_weights is k.forward_comfy_cast_weights
               for k in known if isinstance(m, k))


def _plain(t: Any) -> bool:
    return type(t) in (nn.Parameter, torch.Tensor)


def casts_per_call(m: nn.Module) -> bool:
    """Whether a comfy.ops layer's forward takes its cast path (the condition its own forward tests)."""
    return (getattr(m, "weight", None) is not None and hasattr(m, "comfy_cast_weights")
            and bool(m.comfy_cast_weights or getattr(m, "weight_function", None) or getattr(m, "bias_function", None)))


def _why_not(m: nn.Module, device: torch.device, known: tuple[type, ...]) -> str | None:
    """Why one comfy.ops layer's weights, as held for this call, keep its block stock, or None. A layer ``taken``
    takes needs nothing more; any other is traced as its forward runs, which holds only where its cast is the same at
    every call and on the device (a dtype change, as manual casting on the device always was)."""
    w = getattr(m, "weight", None)
    if casts_per_call(m) and _is_known(m, known) and _plain(w) and (getattr(m, "bias", None) is None
                                                                   or _plain(m.bias)):
        return None
    what = (f"{type(m).__module__}.{type(m).__qualname__}" if not _is_known(m, known)
            else f"{type(m).__qualname__} with a {type(w).__name__} weight")
    if getattr(m, "weight_function", None) or getattr(m, "bias_function", None):
        return f"weight patches applied per call on a layer streamplan does not take ({what})"
    if hasattr(m, "_v") or (isinstance(w, torch.Tensor) and w.device != device):
        return f"weights held off {device} (lowvram or DynamicVRAM) on a layer streamplan does not take ({what})"
    return None


def weights_problem(block: nn.Module, device: torch.device, direct: tuple[str, ...] = ()) -> str | None:
    """Why the block's weights, as ComfyUI holds them for this call, keep the block stock, or None (every comfy.ops
    layer either needs nothing or is taken by ``taken``). ``direct``: layers the block reads the weights of itself
    (their reads, row-independent, run once per call in the block's graph)."""
    known = _known_classes()
    for name, m in block.named_modules():
        if hasattr(m, "comfy_cast_weights") and name not in direct:
            why = _why_not(m, device, known)
            if why:
                return f"{name or 'the block'}: {why}; the block runs stock"
    return None


def quantized_layers(block: nn.Module) -> list[str]:
    """The comfy.ops layers of ``block`` whose weight is a quantized layout (``comfy.quant_ops.QuantizedTensor``):
    their kernels are applied whole to row chunks, never to slices of the weight."""
    return [name for name, m in block.named_modules() if hasattr(m, "comfy_cast_weights")
            and type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]


@dataclass(eq=False)
class Taken:
    """What one block call took: the layers (name -> why they cast), the bytes of tensors taken that are not the
    layers' own storage (device copies, dtype casts, patched weights: live for the whole call), and how."""

    layers: dict[str, str] = field(default_factory=dict)
    new_bytes: int = 0
    prefetched: bool = False       # streamplan ran ComfyUI's DynamicVRAM prefetch for the block
    host_prefetched: bool = False  # the host (its model forward) had prefetched the block

    def note(self) -> str:
        kinds = sorted(set(self.layers.values()))
        how = (" (the block's DynamicVRAM prefetch: " + ("the host's" if self.host_prefetched else "streamplan's")
               + ")") if self.prefetched or self.host_prefetched else ""
        return (f"{len(self.layers)} comfy.ops layer(s) cast per call ({', '.join(kinds)}): weights taken once per "
                f"block call through comfy.ops.cast_bias_weight{how} and held for its chunks")


def _kind(m: nn.Module, device: torch.device) -> str:
    if hasattr(m, "_v"):
        return "DynamicVRAM"
    if getattr(m, "weight_function", None) or getattr(m, "bias_function", None):
        return "weight patches"
    if m.weight.device != device:
        return "offloaded"
    return "comfy_cast_weights"


def _storage(t: torch.Tensor | None) -> int | None:
    try:
        return None if t is None else t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def taken(block: nn.Module, device: torch.device, dtype: torch.dtype, direct: tuple[str, ...] = (),
          classes: tuple[str, ...] = _KNOWN) -> Iterator[Taken]:
    """Inside: every comfy.ops layer of ``block`` that casts per call (but those in ``direct``, whose weights the block
    reads itself) is a plain layer over the weights ComfyUI's cast path gave for ``device`` and ``dtype`` (the dtype
    its inputs have: the block's hidden states'). Call ``weights_problem`` first: a layer it refuses is not taken.
    ``classes``: the comfy.ops classes taken (``_ROW_KNOWN`` for the model forwards' row loops)."""
    import comfy.model_management as mm
    import comfy.ops

    known = _known_classes(classes)
    # every known comfy.ops layer is made plain for the call (the same attributes in every block: one capture); those
    # with a weight that cast per call are taken
    plain = [(name, m) for name, m in block.named_modules()
             if hasattr(m, "comfy_cast_weights") and name not in direct and _is_known(m, known)]
    out = Taken()
    if not any(casts_per_call(m) for _, m in plain):
        yield out
        return
    import comfy.model_prefetch as prefetch
    vbar = [m for _, m in plain if hasattr(m, "_v") and casts_per_call(m)]
    queue = None
    saved: list[tuple[nn.Module, dict, dict, tuple | None]] = []
    try:
        if vbar and not mm.is_device_cpu(device):
            if any(hasattr(m, "_prefetch") for m in block.modules()):
                out.host_prefetched = True   # the host's prefetch queue holds the block: it cleans up
            else:   # ComfyUI's own prefetch of one module's layers, as a one-block queue: faulted together
                one = [None, block, None]
                prefetch.prefetch_queue_pop(one, device, block)
                queue, out.prefetched = one, True
        for name, m in plain:
            result = None
            if casts_per_call(m):
                out.layers[name] = _kind(m, device)
                vbar_layer = hasattr(m, "_v")
                # offloadable=False outside DynamicVRAM: fresh tensors (the async-offload cast buffers are shared by
                # the layers cast on one stream and cannot be held together); a prefetched VBAR layer resolves in place
                result = comfy.ops.cast_bias_weight(m, None, dtype=dtype, device=device, bias_dtype=dtype,
                                                    offloadable=vbar_layer)
            switches = {k: m.__dict__.get(k, _ABSENT) for k in _SWITCHES + _BOOKKEEPING}
            params = {k: m._parameters[k] for k in ("weight", "bias") if k in m._parameters}
            saved.append((m, switches, params, result if result is not None and hasattr(m, "_v") else None))
            for k in _BOOKKEEPING:
                m.__dict__.pop(k, None)
            m.comfy_cast_weights, m.weight_function, m.bias_function = False, [], []
            if result is None:
                continue
            for t, key in ((result[0], "weight"), (result[1], "bias")):
                if t is None or params.get(key) is None:
                    continue
                if _storage(t) != _storage(params[key]):
                    out.new_bytes += t.numel() * t.element_size()
                m._parameters[key] = nn.Parameter(t, requires_grad=False)
        yield out
    finally:
        for m, switches, params, result in reversed(saved):
            m._parameters.update(params)
            for k, v in switches.items():
                if v is _ABSENT:
                    m.__dict__.pop(k, None)
                else:
                    m.__dict__[k] = v
            if result is not None and len(result) > 2:
                comfy.ops.uncast_bias_weight(m, result[0], result[1], result[2])
        saved.clear()
        if queue is not None:
            prefetch.prefetch_queue_pop(queue, device, None)   # waits for the streams, unpins, drops the prefetch


def _row_layers(modules: tuple[nn.Module, ...]) -> list[tuple[str, nn.Module]]:
    """The comfy.ops layers of ``modules`` a row loop may take (a class whose cast path was read, plain tensors),
    each named by its module's place in ``modules`` and class and its path there."""
    known = _known_classes(_ROW_KNOWN)
    return [(".".join(filter(None, (f"{i}:{type(module).__name__}", name))), m)
            for i, module in enumerate(modules) for name, m in module.named_modules()
            if hasattr(m, "comfy_cast_weights") and _is_known(m, known) and _plain(getattr(m, "weight", None))
            and (getattr(m, "bias", None) is None or _plain(m.bias))]


@contextlib.contextmanager
def once_per_loop(*modules: nn.Module) -> Iterator[Taken]:
    """Inside: a model forward's row loop over ``modules`` (patch embedding, output head) casts each layer's weights
    once, not once per row chunk. A layer that casts per call is ``taken`` at its first call, with that call's input
    dtype and device (what its own cast would use), and stays a plain layer over those weights for the loop's later
    calls (its own forward, the same kernels). Layers of other classes or with non-plain weights (quantized layouts,
    custom ops), and a first call with keyword arguments (Conv3d's ``autopad``), keep their own call per chunk. The
    yielded ``Taken`` gathers what was taken."""
    out = Taken()
    with contextlib.ExitStack() as stack:
        def first_call(name: str, m: nn.Module, args: tuple, kwargs: dict) -> None:
            handles.pop(name).remove()
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and casts_per_call(m) and not kwargs:
                one = stack.enter_context(taken(m, x.device, x.dtype, classes=_ROW_KNOWN))
                out.layers.update({name: kind for kind in one.layers.values()})
                out.new_bytes += one.new_bytes

        handles = {name: m.register_forward_pre_hook(functools.partial(first_call, name), with_kwargs=True)
                   for name, m in _row_layers(modules)}
        stack.callback(lambda: [h.remove() for h in handles.values()])
        yield out
