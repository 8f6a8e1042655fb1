"""Specs: plain descriptions of a structure in row-local pieces, produced by recognizers."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor]
MLPLayout = Literal["plain", "gated-fused", "gated-separate"]


@dataclass(eq=False)
class MLPSpec:
    """``out_proj(hidden(x))`` where every hidden feature depends only on its own projection rows.

    plain:          hidden = act(in_proj(x))
    gated-fused:    in_proj gives [up | gate] (or [gate | up]); hidden = up * act(gate)
    gated-separate: hidden = act(gate_proj(x)) * in_proj(x)
    ``act`` is elementwise, so it may be applied to any slice of features.
    """

    module: nn.Module
    label: str
    layout: MLPLayout
    in_proj: nn.Linear
    out_proj: nn.Linear
    act: Activation
    ffn: int
    gate_proj: nn.Linear | None = None
    gate_first: bool = False  # gated-fused only: the gate is the first half

    @property
    def dim_in(self) -> int:
        return self.in_proj.in_features

    @property
    def dim_out(self) -> int:
        return self.out_proj.out_features

    @property
    def proj_width(self) -> int:
        """Features produced by the input projection(s) before the activation, per row."""
        return self.ffn if self.layout == "plain" else 2 * self.ffn

    def hidden(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Activated hidden features [a:b) for rows x; never builds the other features."""
        w, bias = self.in_proj.weight, self.in_proj.bias
        if self.layout == "plain":
            return self.act(F.linear(x, w[a:b], None if bias is None else bias[a:b]))
        if self.layout == "gated-separate":
            g = self.gate_proj
            gate = F.linear(x, g.weight[a:b], None if g.bias is None else g.bias[a:b])
            up = F.linear(x, w[a:b], None if bias is None else bias[a:b])
            return self.act(gate) * up
        off_gate, off_up = (0, self.ffn) if self.gate_first else (self.ffn, 0)
        up = F.linear(x, w[off_up + a:off_up + b], None if bias is None else bias[off_up + a:off_up + b])
        gate = F.linear(x, w[off_gate + a:off_gate + b], None if bias is None else bias[off_gate + a:off_gate + b])
        return up * self.act(gate)

    def projections(self) -> list[nn.Module]:
        return [m for m in (self.in_proj, self.gate_proj, self.out_proj) if m is not None]


@dataclass
class Skip:
    """A module left stock, and why (shown by ``handle.report()``)."""

    name: str
    cls: str
    reason: str


@dataclass(eq=False)
class Segment:
    """A run of rows of the attention's (joint) sequence with its own row-local pieces.

    ``source`` is the segment's input sequence [B, rows, dim]. q(h, a, b) -> [B, b-a, H, D] and
    kv(h, a, b) -> two [B, b-a, Hkv, D] take the input rows h = source[:, a:b] (or, inside a streamed block, the
    block's prefix of those rows); out(o, a, b) maps attention output rows [B, b-a, H, D] to output rows
    [B, b-a, dout]. Rows a, b are local to the segment.
    """

    source: torch.Tensor
    q: Callable[[torch.Tensor, int, int], torch.Tensor]
    kv: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]] | None
    out: Callable[[torch.Tensor, int, int], torch.Tensor]

    @property
    def rows(self) -> int:
        return self.source.shape[1]


@dataclass(eq=False)
class AttentionCall:
    """One call of a recognised attention module, taken apart into row-local pieces."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    segments: list[Segment]
    finish: Callable[[list[torch.Tensor]], object]  # per-segment outputs -> the module's return value
    dtype: torch.dtype
    causal: bool = False
    scale: float | None = None
    mask: torch.Tensor | None = None                # [B|1, H|1, Nq|1, Nk], rows = joint query rows
    mask_rows: Callable[[int, int], torch.Tensor] | None = None  # builds the mask of joint rows [a:b) on demand
    kv_whole: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None  # cross-attention: [B, S, Hkv, D]
    cache_update: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)


Binder = Callable[[tuple, dict], "AttentionCall | str"]


@dataclass(eq=False)
class AttentionSpec:
    """An attention module streamplan can run as phase KV then phase Q (DESIGN.md section 1).

    ``bind(args, kwargs)`` takes one call apart (or returns why this call must run stock); ``backend`` names
    the attention implementation the module uses, which selects the consumer.
    """

    module: nn.Module
    label: str
    heads: int
    kv_heads: int
    head_dim: int
    dim_out: int
    bind: Binder
    backend: Callable[[], str]


@dataclass(eq=False)
class ModelSpec:
    """A whole model whose forward streamplan runs itself (with the model's own submodules): blocks may update
    the hidden states in place, and the output head runs in row chunks. Its blocks are recognised on their own."""

    module: nn.Module
    label: str
    run: Callable[[tuple, dict, Callable[[], int]], object]   # (args, kwargs, chunk for its own row loops) -> output
    can_stream: Callable[[tuple, dict], "str | None"]  # why this call must run the stock forward, or None


@dataclass(eq=False)
class RowLocalSpec:
    """A module whose output rows depend only on the same input rows (a norm, a modulated norm): run on chunks of
    the sequence dimension, each written into one output. Keeps fp32 promotions per chunk."""

    module: nn.Module
    label: str
    transient_per_elem: int   # elements alive per input element in the stock forward (fp32 counted double)


@dataclass(eq=False)
class GraphSpec:
    """A block no hand-written recognizer knows, streamed from its own captured graph (captured at its first call
    per input signature; ``streamplan.capture`` says what it can run and why not)."""

    module: nn.Module
    label: str


# Custom ops (by namespace and name) a library's recognizer declares row-local, for the captured-graph analysis:
# "rows": every output row is its inputs' own rows (rotary with a per-row table, norms over a head's features);
# "norm": a norm over the last dimension with elementwise modulation (rows must not be that dimension).
ROW_LOCAL_CUSTOM_OPS: dict[tuple[str, str], Literal["rows", "norm"]] = {}


def register_row_local_op(namespace: str, name: str, kind: Literal["rows", "norm"]) -> None:
    if kind not in ("rows", "norm"):
        raise ValueError(f"kind must be 'rows' or 'norm', got {kind!r}")
    ROW_LOCAL_CUSTOM_OPS[(namespace, name)] = kind


# Private attributes a module's forward reads as settings (peft: an adapter switched off, the active adapter's name),
# declared by the library's recognizer file: a capture depends on their values (``capture.export.structure``).
CAPTURE_STATE_ATTRS: set[str] = set()


def register_capture_state(*names: str) -> None:
    CAPTURE_STATE_ATTRS.update(names)


# What a library changes while a block of its is captured, and only then: ``(block) -> context manager | None``
# (ComfyUI: its selected attention function, Sage say, does not trace; the capture traces its PyTorch one, while the
# streamed chunks still go to the selected one through the consumer).
CAPTURE_CONTEXTS: list[Callable[[nn.Module], "AbstractContextManager | None"]] = []


def register_capture_context(context: Callable[[nn.Module], "AbstractContextManager | None"]) -> None:
    if context not in CAPTURE_CONTEXTS:
        CAPTURE_CONTEXTS.append(context)


# Layers a capture takes as one opaque row-local op (``capture.opaque_layers``), run by the layer's own forward on
# each chunk of rows: ``(module) -> bool``, declared by whoever knows the layer's format (``recognize``, from
# ``weights.LinearCaps.opaque``: bitsandbytes' linears).
OPAQUE_LAYERS: list[Callable[[nn.Module], bool]] = []


def register_opaque_layer(matches: Callable[[nn.Module], bool]) -> None:
    if matches not in OPAQUE_LAYERS:
        OPAQUE_LAYERS.append(matches)


# Argument records: dataclasses of tensors a block takes as arguments (ComfyUI Flux's ``ModulationOut``), declared by
# the library's recognizer file as "module:QualName". The capture flattens them into their fields (registering them
# as pytree nodes when first met); any other object argument keeps its block stock.
ARGUMENT_RECORDS: set[str] = set()


def register_argument_record(path: str) -> None:
    if ":" not in path:
        raise ValueError(f"an argument record is named 'module:QualName', got {path!r}")
    ARGUMENT_RECORDS.add(path)


# Who decides a captured block's attention kernel: a library whose modules dispatch attention through a backend of
# their own (diffusers' attention backends) registers a probe ``(block) -> backend name | None``; a block whose
# backend has no streamplan consumer runs stock, named, as a hand-written attention does.
BACKEND_PROBES: list[Callable[[nn.Module], "str | None"]] = []


def register_backend_probe(probe: Callable[[nn.Module], "str | None"]) -> None:
    if probe not in BACKEND_PROBES:
        BACKEND_PROBES.append(probe)


def block_backend(block: nn.Module) -> str | None:
    """The attention backend a block's own library dispatches to, where one says (None: plain PyTorch SDPA)."""
    for probe in BACKEND_PROBES:
        found = probe(block)
        if found is not None:
            return found
    return None


@dataclass(eq=False)
class AdaptedCall:
    """A call as a captured graph can take it: an object the graph cannot hold (a KV cache) taken out, and what the
    stock call would have done with it done afterwards from the graph's own K and V ([B, Hkv, N, D])."""

    args: tuple
    kwargs: dict
    kv_heads: int                                               # the K/V heads ``fill`` expects
    fill: Callable[[torch.Tensor, torch.Tensor], None]


# A library whose blocks take an object a capture cannot (transformers' caches) registers an adapter
# ``(block, args, kwargs) -> AdaptedCall | reason | None`` (None: not this library's call).
CALL_ADAPTERS: list[Callable[[nn.Module, tuple, dict], "AdaptedCall | str | None"]] = []


def register_call_adapter(adapter: Callable[[nn.Module, tuple, dict], "AdaptedCall | str | None"]) -> None:
    if adapter not in CALL_ADAPTERS:
        CALL_ADAPTERS.append(adapter)


def adapt_call(block: nn.Module, args: tuple, kwargs: dict) -> "AdaptedCall | str | None":
    for adapter in CALL_ADAPTERS:
        found = adapter(block, args, kwargs)
        if found is not None:
            return found
    return None


# A library whose calls pass objects that hold tensors (transformers' caches) registers how to list them:
# ``(value) -> list of tensors | None`` (None: not its object). Those objects count toward a call's live inputs and are
# copied whole for a reference run (``verify.private_copy``).
STATE_TENSORS: list[Callable[[Any], "list[torch.Tensor] | None"]] = []


def register_state_tensors(lister: Callable[[Any], "list[torch.Tensor] | None"]) -> None:
    if lister not in STATE_TENSORS:
        STATE_TENSORS.append(lister)


def state_tensors(value: Any) -> "list[torch.Tensor] | None":
    """The tensors a registered state object (a cache) holds, or None when ``value`` is not one."""
    for lister in STATE_TENSORS:
        found = lister(value)
        if found is not None:
            return found
    return None


@dataclass(eq=False)
class RowMask:
    """An attention mask over a call's own rows (query rows x key rows), described instead of built: a model forward
    passes one in place of the ``[B, 1, N, N]`` tensor its library would build (a padded batch, a sliding window),
    to a layer whose forward takes row masks (``takes_row_masks``). A streamed layer builds each Q chunk's rows
    alone; a stock call gets ``whole()``, the tensor the library builds.

    ``span(a, b)``: the keys [lo, hi) outside which every query row of [a, b) is masked; ``part(a, b, lo, hi)``:
    query rows [a, b) against keys [lo, hi) as a bool ``[B, 1, b - a, hi - lo]`` (True: attend), from the library's
    own mask function; ``window``: the sliding window (None: every earlier key)."""

    batch: int
    rows: int
    keys: int
    part: Callable[[int, int, int, int], torch.Tensor]
    span: Callable[[int, int], tuple[int, int]]
    whole: Callable[[], "torch.Tensor | None"]
    window: int | None = None
    # where the mask is padding and causality alone (no window): per batch element the keys [start, end) that are
    # not padding; query row i then sees keys start..min(i, end - 1), and a row before start none
    spans: tuple[tuple[int, int], ...] | None = None
    # eager attention's additive masks: a row that sees no key adds the same minimum to every score, so it attends
    # every key of the call evenly (not only those of its chunk's span)
    blind_rows_see_all: bool = False

    def chunk_bytes(self, chunk: int, elem: int, row_bytes: int = 0) -> int:
        """Bytes of one chunk's mask rows at their worst: the bool rows and the kernel's additive copy of them; with
        ``spans``, no mask rows but each batch element's attention output (``row_bytes`` per row) copied in."""
        c = min(chunk, self.rows)
        if self.spans is not None:
            return c * row_bytes
        keys = min(self.keys, c + self.window - 1) if self.window else self.keys
        return self.batch * c * keys * (1 + elem)


# set on a streamplan forward that takes RowMask arguments (a block streamed from its captured graph)
ROW_MASK_MARK = "_streamplan_takes_row_masks"


def takes_row_masks(module: nn.Module) -> bool:
    """Whether ``module``'s installed forward takes ``RowMask`` arguments (and builds them whole for a stock call)."""
    return bool(getattr(module.__dict__.get("forward"), ROW_MASK_MARK, False))


def row_masks_whole(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with every ``RowMask`` argument built whole, as a stock forward takes it."""
    if not any(isinstance(v, RowMask) for v in (*args, *kwargs.values())):
        return args, kwargs
    return (tuple(v.whole() if isinstance(v, RowMask) else v for v in args),
            {k: (v.whole() if isinstance(v, RowMask) else v) for k, v in kwargs.items()})
