"""What a user asks ``apply`` for, validated once: budget, chunking and tier overrides."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .execute.kv_tiers import check_kv
from .plan.budget import DEFAULT_RESERVE, parse_budget


@dataclass
class StreamOptions:
    budget: int | str | None = None   # bytes, or "auto" (free device memory at planning time less ``reserve``)
    reserve: int = DEFAULT_RESERVE
    chunk_tokens: int | None = None
    ffn_slice: int | None = None
    self_check: bool = False
    head_groups: int | None = None
    kv: str = "device"   # where K/V live between the phases: device (exact), host (L4), int8 / fp8 (L5, approximate)
    # the budget is a target, not a ceiling: where nothing fits it, plan at the smallest reachable peak (reported)
    # instead of raising (ComfyUI's "auto": its DynamicVRAM weights fill the card and are evicted on demand)
    smallest_when_short: bool = False
    # row-local chains of a captured block (norms, rotary, modulation) run in this many pieces of each chunk's rows:
    # a lower peak per row, more and smaller kernels (1: whole; see ``capture.pieces``)
    row_pieces: int = 1
    # K/V in a store (kv="host", "int8", "fp8") at a fixed chunk: query rows attended per pass over the store
    q_span: int | None = None
    # a captured block's element-wise chains compiled into exact kernels (``capture.fuse``): None where the device
    # is CUDA with Triton, True anywhere Inductor runs, False never
    fuse: bool | None = None


_INT_MEANING = {"chunk_tokens": "rows per chunk", "ffn_slice": "MLP hidden features per slice",
                "head_groups": "groups the K/V heads are split into",
                "row_pieces": "pieces of a chunk's rows its row-local chains run in",
                "q_span": "query rows attended per pass over a K/V store"}


def positive_int(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int ({_INT_MEANING[arg]}) or None, got {value!r}")
    return value


def make_options(budget, chunk_tokens, ffn_slice, head_groups, reserve, self_check, kv="device",
                 row_pieces=None, q_span=None, fuse=None) -> StreamOptions:
    kv = check_kv(kv)
    chunk_tokens = positive_int(chunk_tokens, "chunk_tokens")
    ffn_slice = positive_int(ffn_slice, "ffn_slice")
    head_groups = positive_int(head_groups, "head_groups")
    reserve = parse_budget(reserve, None, arg="reserve", allow_zero=True)
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        parsed: int | str | None = "auto"   # resolved when each operation is planned, from what is free then
    else:
        parsed = parse_budget(budget, None)
    pieces = positive_int(row_pieces, "row_pieces") or 1
    q_span = positive_int(q_span, "q_span")
    if q_span is not None and kv == "device":
        raise ValueError(f"q_span={q_span} sets the query rows of a pass over a K/V store: it needs kv='host', 'int8' "
                         f"or 'fp8' (with kv='device' the planner picks any span itself when it stages K/V)")
    if fuse is not None and not isinstance(fuse, bool):
        raise ValueError(f"fuse must be True, False or None (None: fuse where the device is CUDA with Triton), "
                         f"got {fuse!r}")
    return StreamOptions(parsed, reserve, chunk_tokens, ffn_slice, bool(self_check), head_groups, kv,
                         row_pieces=pieces, q_span=q_span, fuse=fuse)
