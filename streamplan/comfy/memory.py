"""Budgets inside ComfyUI. ComfyUI owns the weights (it loads, offloads and casts them), so a streamplan budget there
is activation room, never a share of the card:

- ``"auto"``: what ComfyUI's ``comfy.model_management.get_free_memory(device)`` reports free (the driver's free memory
  plus what PyTorch's cache holds unused) less ``extra_reserved_memory()`` (``--reserve-vram``) and the node's
  ``reserve``, read when a block is planned. Weights that DynamicVRAM (comfy-aimdo) could evict are not counted as
  free: ``ModelPatcher.get_free_memory`` adds them for batching decisions, streamplan does not use it.
- bytes (``"12GiB"``): the activation ceiling above what is allocated when the block is entered (its inputs, the
  residual, the weights): a block plans its chunks to stay within it.
- ``None``: no planning; every long enough call streams at ``chunk_tokens`` (or the default chunk).

``room_for`` is that room; ``streamer_budget`` turns it into the byte budget a ``BlockStreamer`` plans under (which
counts the call's live inputs inside its budget)."""
from __future__ import annotations

from typing import Any

import torch

from ..callstate import live_bytes
from ..budget import DEFAULT_RESERVE, parse_budget


def room_for(options: Any, device: torch.device) -> int | None:
    """Activation bytes a call may use under ``options.budget`` on ``device`` (None: no budget)."""
    budget = options.budget
    if budget is None:
        return None
    if budget != "auto":
        return int(budget)
    import comfy.model_management as mm
    reserve = DEFAULT_RESERVE if options.reserve is None else parse_budget(options.reserve, None, arg="reserve",
                                                                             allow_zero=True)
    return max(0, int(mm.get_free_memory(device)) - int(mm.extra_reserved_memory()) - reserve)


def streamer_budget(options: Any, args: tuple, kwargs: dict, device: torch.device) -> int | None:
    """The byte budget for one block call's ``BlockStreamer``: the room plus the call's live inputs."""
    room = room_for(options, device)
    return None if room is None else room + live_bytes(args, kwargs)


def weights_problem(block: Any, device: torch.device) -> str | None:
    """Why a block's weights, as ComfyUI holds them for this call, keep the block stock, or None.

    ``comfy.ops`` layers cast their weights at every call (``cast_bias_weight``). Where the weight is on the call's
    device that cast (a dtype change under manual casting) is traced into the block's graph among the values that do
    not depend on the rows, so it runs once per block call, not once per chunk. Two cases are not streamed yet:
    weight or bias functions (LoRA and other patches ComfyUI applies at call time under lowvram): the graph would keep
    the function traced at capture, shared by every block of the class; and weights that live off the call's device
    (lowvram offload, DynamicVRAM's evictable weights), which ComfyUI moves per call on its own streams."""
    functions, away = [], []
    for name, m in block.named_modules():
        if not hasattr(m, "comfy_cast_weights"):
            continue
        if getattr(m, "weight_function", None) or getattr(m, "bias_function", None):
            functions.append(name)
        w = getattr(m, "weight", None)
        if hasattr(m, "_v") or (isinstance(w, torch.Tensor) and w.device != device):
            away.append(name)
    if functions:
        return (f"weight patches applied per call (lowvram LoRA) on {len(functions)} layer(s) ({functions[0]}, ...): "
                "the block runs stock")
    if away:
        return (f"{len(away)} layer(s) hold their weights off {device} (lowvram offload or DynamicVRAM: "
                f"{away[0]}, ...): the block runs stock (ComfyUI's --disable-dynamic-vram, --highvram or --gpu-only "
                "keep them on the device)")
    return None


def quantized_layers(block: Any) -> list[str]:
    """The comfy.ops layers of ``block`` whose weight is a quantized layout (``comfy.quant_ops.QuantizedTensor``):
    their kernels are applied whole to row chunks, never to slices of the weight."""
    return [name for name, m in block.named_modules() if hasattr(m, "comfy_cast_weights")
            and type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]
