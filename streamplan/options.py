"""What a user asks ``apply`` for, as one object validated once: every keyword of ``apply`` is a field here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .execute.kv_tiers import check_kv
from .integrations.recognizers import CAPTURE_MODES
from .plan.budget import DEFAULT_RESERVE, parse_budget

HIDDEN_PLACES = ("auto", "device", "host")


@dataclass
class StreamOptions:
    """How ``streamplan.apply`` streams a model (in the manner of torchao's ``quantize_`` configs): pass one as
    ``apply(model, options=...)``, or give its fields to ``apply`` as keywords. Fields are checked and normalised when
    the object is made (a size string becomes bytes); a bad value raises ``ValueError`` naming the field.

    Args:
        budget: the activation memory the planner may use: bytes (an int), a size string (``"12GiB"``, ``"900MB"``,
            ``"1e9"``), or ``"auto"`` (default: the device's free memory less ``reserve``, read when an operation is
            first planned). The planner keeps stock wherever stock fits and picks tiers and chunk sizes elsewhere;
            a budget nothing fits raises ``BudgetError``. ``None``: no budget, every input longer than a fixed
            default chunk streams.
        chunk_tokens: rows per chunk, forced (phase KV and phase Q run that many rows a step).
        ffn_slice: hidden features of an MLP held at a time, forced (tier L2): a captured block's MLP runs on as many
            row pieces of the chunk as that takes, exact; a hand-written MLP a slice of its features at a time.
        head_groups: groups the K/V heads are split into, forced (tier L3: the attention output built a head group
            at a time).
        reserve: bytes (or a size string) ``budget="auto"`` leaves free.
        self_check: run the first streamed call stock as well, and log and report the difference (a check, not a
            streamed run: that call also takes stock's peak, and holds stock's output beside the streamed call; the
            report says how much).
        capture: the way in for blocks: ``"fallback"`` (default: every block from its captured graph unless a part
            recognizer knows the block itself), ``"prefer"`` (capture every block), ``"off"`` (hand-written parts
            and model forwards only).
        kv: where a captured block's K and V live between its phases: ``"device"`` (default, exact; below the floor
            the planner may still stage them on the host, L4), ``"host"`` (forces L4: pinned host memory, attended
            block by block, exact up to a log-sum-exp merge in fp32), ``"int8"`` or ``"fp8"`` (L5: compressed on
            the device, approximate, opt-in; the first call per input shape measures the error where it enters the
            block, on its last query rows against exact K/V attended as phase KV makes them, never held whole, so
            that call stays below the exact tier too; the report gives the error and the check's extra bytes).
        row_pieces: a captured block's row-local chains (norms, rotary, modulation) run in this many row pieces of
            each chunk: a lower peak per row, more and smaller kernels (1: whole chunks; ``None``, the default:
            the planner chooses, under a budget).
        q_span: with K/V in a store and ``chunk_tokens``: query rows built and attended in one pass over the store
            (a span of chunks), so the store is read once per span (under a budget the planner picks the span).
        kv_block: with K/V in a store and ``chunk_tokens``: K/V rows per block read back from the store in phase Q
            (default: a pass's query rows, up to 8,192 a head group; under a budget the planner picks the block).
        fuse: a captured block's chains of element-wise ops compiled by Inductor into one kernel each that rounds
            as eager does, checked bit for bit on a first chunk (a chain that differs runs eager, reported).
            ``None`` (default): where the device is CUDA with Triton; ``True``: wherever Inductor runs; ``False``:
            never.
        hidden: where a model forward streamplan runs keeps its hidden state between blocks: ``"auto"`` (default:
            on the device, and in host memory (L6, exact) only under a budget below what the forward reaches with it
            on the device), ``"device"`` (never in host memory), ``"host"`` (always, where the forward can: pinned
            host memory, each block reading its chunks back). Host memory needed is in the report; where it cannot
            be had, ``HostMemoryError`` before anything runs.
        replay: a captured block's chunks of one size, after its first two, replayed as recorded CUDA graphs (the
            runs between its attentions; each attention eager for its chunk): a few launches a chunk where each of
            its ~100 ops costs microseconds of dispatch that short chunks no longer hide; the same kernels on the
            same values (its rows are staged in and out, priced in the plan). ``None`` (default): where the
            planner's time model says it is faster, on a device whose replay rates are fitted (none yet:
            docs/budgets-and-tiers.md, the time model); ``True``: wherever the block allows it (off CUDA the chunks
            re-run through the same staging: a check, not a speed-up; what a block does not allow, such as a
            convolution along the rows, is in the report); ``False``: never.
        smallest_when_short: the budget is a target, not a ceiling: where no plan fits it, plan at the smallest
            peak the planner reaches (noted in the report) instead of raising (ComfyUI's ``"auto"``, whose weights
            fill the card and are evicted on demand).

    Example:
        >>> options = streamplan.StreamOptions(budget="12GiB", kv="host")
        >>> handle = streamplan.apply(pipe.transformer, options=options)
        >>> # the same as streamplan.apply(pipe.transformer, budget="12GiB", kv="host")
    """

    budget: int | str | None = "auto"
    chunk_tokens: int | None = None
    ffn_slice: int | None = None
    head_groups: int | None = None
    reserve: int | str = DEFAULT_RESERVE
    self_check: bool = False
    capture: str = "fallback"
    kv: str = "device"
    row_pieces: int | None = None
    q_span: int | None = None
    fuse: bool | None = None
    smallest_when_short: bool = False
    hidden: str = "auto"
    replay: bool | None = None
    kv_block: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, str) or self.hidden.strip().lower() not in HIDDEN_PLACES:
            raise ValueError(f"hidden must be one of {', '.join(repr(h) for h in HIDDEN_PLACES)} (where a model "
                             f"forward keeps its hidden state between blocks), got {self.hidden!r}")
        self.hidden = self.hidden.strip().lower()
        self.kv = check_kv(self.kv)
        self.chunk_tokens = positive_int(self.chunk_tokens, "chunk_tokens")
        self.ffn_slice = positive_int(self.ffn_slice, "ffn_slice")
        self.head_groups = positive_int(self.head_groups, "head_groups")
        self.reserve = parse_budget(self.reserve, None, arg="reserve", allow_zero=True)
        if isinstance(self.budget, str) and self.budget.strip().lower() == "auto":
            self.budget = "auto"   # resolved when each operation is planned, from what is free then
        else:
            self.budget = parse_budget(self.budget, None)
        self.row_pieces = positive_int(self.row_pieces, "row_pieces")
        self.q_span = positive_int(self.q_span, "q_span")
        if self.q_span is not None and self.kv == "device":
            raise ValueError(f"q_span={self.q_span} sets the query rows of a pass over a K/V store: it needs "
                             f"kv='host', 'int8' or 'fp8' (with kv='device' the planner picks any span itself when "
                             f"it stages K/V)")
        self.kv_block = positive_int(self.kv_block, "kv_block")
        if self.kv_block is not None and self.kv == "device":
            raise ValueError(f"kv_block={self.kv_block} sets the K/V rows read back per block from a K/V store: it "
                             f"needs kv='host', 'int8' or 'fp8' (with kv='device' the planner picks any block itself "
                             f"when it stages K/V)")
        if self.fuse is not None and not isinstance(self.fuse, bool):
            raise ValueError(f"fuse must be True, False or None (None: fuse where the device is CUDA with Triton), "
                             f"got {self.fuse!r}")
        if self.replay is not None and not isinstance(self.replay, bool):
            raise ValueError(f"replay must be True, False or None (None: where the planner's time model says it is "
                             f"faster), got {self.replay!r}")
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {', '.join(CAPTURE_MODES)}; got {self.capture!r}")
        self.self_check = bool(self.self_check)
        self.smallest_when_short = bool(self.smallest_when_short)


_INT_MEANING = {"chunk_tokens": "rows per chunk", "ffn_slice": "MLP hidden features per slice",
                "head_groups": "groups the K/V heads are split into",
                "row_pieces": "pieces of a chunk's rows its row-local chains run in",
                "q_span": "query rows attended per pass over a K/V store",
                "kv_block": "K/V rows read back per block from a K/V store"}


def positive_int(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int ({_INT_MEANING[arg]}) or None, got {value!r}")
    return value
