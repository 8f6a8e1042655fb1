"""What every streamed ComfyUI model forward's own row loops share: the rows per chunk of a loop (from the room under
the budget), a loop's comfy.ops layers cast once for it, and one block called through its "dit" replacement with its
input donated where the replacement is streamplan's."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...execute.call_state import rehearsing
from ...execute.donation import donate
from .memory import room_for
from .weights import once_per_loop

DEFAULT_CHUNK = 16384
MIN_CHUNK = 256


@contextlib.contextmanager
def row_loop(state: Any, *modules: torch.nn.Module):
    """A row loop of a streamed model forward over ``modules``: their comfy.ops layers cast their weights once for
    the loop (``weights.once_per_loop``), counted in the call's ``ModelCalls.weights_once``."""
    with once_per_loop(*modules) as took:
        yield
    if not rehearsing():   # a rehearsal (``forward_budget``) is not a call
        state.forward.weights_once += len(took.layers)


def chunk_rows(state: Any, device: torch.device, row_bytes: int) -> int:
    """Rows per chunk of the model's own loops (projections, head), recorded for the call's report:
    ``chunk_tokens`` when given; in a forward planned ahead under a size budget, its blocks' smallest planned chunk
    (``forward_budget.loop_chunk``: called again before the head, once the blocks planned); else as many rows as a
    quarter of the room on ``device`` holds at ``row_bytes`` per row, within [MIN_CHUNK, DEFAULT_CHUNK]."""
    options = state.options
    if options.chunk_tokens:
        chunk = int(options.chunk_tokens)
    elif state.forward.loop_chunk is not None:   # a forward planned ahead (``forward_budget``): its blocks' chunk
        chunk = state.forward.loop_chunk(state)
    else:
        room = room_for(options, device)
        chunk = DEFAULT_CHUNK if room is None else int(min(DEFAULT_CHUNK, max(MIN_CHUNK,
                                                                             room // max(1, 4 * row_bytes))))
    state.forward.chunk = chunk
    return chunk


def block_call(blocks_replace: dict, key: tuple, x: torch.Tensor, args: dict, block_wrap):
    """One block through its "dit" replacement (``args`` as the host builds them), with ``x`` donated when the
    replacement is streamplan's own (a foreign one may keep its input to compare)."""
    replacement = blocks_replace[key]
    if getattr(replacement, "streamplan_donates", False):
        with donate(x):
            return replacement(args, {"original_block": block_wrap})["img"], True
    return replacement(args, {"original_block": block_wrap})["img"], False
