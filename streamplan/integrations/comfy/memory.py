"""Budgets inside ComfyUI. ComfyUI owns the weights (it loads, offloads and casts them), so a streamplan budget there
is activation room, never a share of the card:

- ``"auto"``: what ComfyUI's ``comfy.model_management.get_free_memory(device)`` reports free (the driver's free memory
  plus what PyTorch's cache holds unused) less ``extra_reserved_memory()`` (``--reserve-vram``) and the node's
  ``reserve``, read when a block is planned, after the block's weights were taken (``weights.taken``: under lowvram
  or DynamicVRAM the block's cast weights are live for its whole call, so they are not free). Weights that
  DynamicVRAM (comfy-aimdo) could evict are not counted as free: ``ModelPatcher.get_free_memory`` adds them for
  batching decisions, streamplan does not use it. "auto" never refuses: where that room holds no plan (DynamicVRAM
  fills the card with weights it evicts on demand, so a model larger than the card leaves little free), the block
  streams at the smallest peak the planner reaches (its smallest chunk, head groups where the graph allows), and the
  report says so; ComfyUI evicts weights for it as it would for the stock block.
- bytes (``"12GiB"``): for a model forward streamplan runs and plans whole (``forward_budget``), what the whole
  model call may add above what was allocated when it began, its blocks planned ahead within it. Otherwise the
  activation ceiling above what is allocated when the block is entered (its inputs, the residual, ComfyUI's
  weights): a block plans its chunks to stay within it, and the copies its cast weights need (device moves, dtype
  casts, patched weights) are paid from it. A ceiling: below the smallest peak the block reaches, ``BudgetError``
  before any work of that block runs, naming that peak.
- ``None``: no planning; every long enough call streams at ``chunk_tokens`` (or the default chunk).

``room_for`` is that room; ``streamer_budget`` turns it into the byte budget a ``BlockStreamer`` plans under (which
counts the call's live inputs inside its budget)."""
from __future__ import annotations

from typing import Any

import torch

from ...execute.call_state import live_bytes
from ...plan.budget import DEFAULT_RESERVE, parse_budget


def room_for(options: Any, device: torch.device, taken: int = 0) -> int | None:
    """Activation bytes a call may use under ``options.budget`` on ``device`` (None: no budget). ``taken``: bytes the
    call already holds beyond ComfyUI's own weights (the block's cast weights, ``weights.taken``): an explicit budget
    pays for them; "auto" reads free memory after they were taken, so they are not free there already."""
    budget = options.budget
    if budget is None:
        return None
    if budget != "auto":
        return max(0, int(budget) - taken)
    import comfy.model_management as mm
    reserve = DEFAULT_RESERVE if options.reserve is None else parse_budget(options.reserve, None, arg="reserve",
                                                                             allow_zero=True)
    return max(0, int(mm.get_free_memory(device)) - int(mm.extra_reserved_memory()) - reserve)


def streamer_budget(options: Any, args: tuple, kwargs: dict, device: torch.device, taken: int = 0) -> int | None:
    """The byte budget for one block call's ``BlockStreamer``: the room plus the call's live inputs."""
    room = room_for(options, device, taken)
    return None if room is None else room + live_bytes(args, kwargs)
