"""Specs: plain descriptions of a structure as row-local functions, produced by recognizers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

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
    """A run of rows of the attention's (joint) sequence with its own row-local functions.

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


@dataclass(frozen=True, eq=False)
class KVFrame:
    """K/V buffers of ``keys`` rows, zeros but for the call's rows from row ``rows_at`` and what ``fill(k, v)`` writes
    into them ([B, keys, Hkv, D]): the padded layout a flex ``BlockMask`` indexes, with keys that are not the call's
    rows (a read cache's, before or after them)."""

    keys: int
    fill: Callable[[torch.Tensor, torch.Tensor], None]
    rows_at: int = 0


@dataclass(eq=False)
class AttentionCall:
    """One call of a recognised attention module, taken apart into row-local functions."""

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
    kv_frame: KVFrame | None = None                 # the rows' K/V placed in a longer buffer (a flex mask's layout)
    # a value built once from every row when K and V are whole (a mask chosen from the call's Q and K), in bytes: what
    # it keeps through the attention, its build's transients, and the inputs the streamed call holds for it alone
    built_held: int = 0
    built_transient: int = 0
    built_inputs: int = 0

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def keys(self) -> int:
        return self.kv_frame.keys if self.kv_frame is not None else self.rows


Binder = Callable[[tuple, dict], "AttentionCall | str"]


@dataclass(eq=False)
class AttentionSpec:
    """An attention module streamplan can run as phase KV then phase Q (docs/design.md, "Why a block can stream").

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
    run: Callable[[tuple, dict, "RowLoops"], object]   # (args, kwargs, how its own row loops run) -> output
    can_stream: Callable[[tuple, dict], "str | None"]  # why this call must run the stock forward, or None
    host_rows: bool = False   # the forward can keep its hidden state in host memory between blocks (L6)


@dataclass(eq=False)
class RowLoops:
    """How a model forward streamplan runs runs its own row loops: ``chunk()`` rows at a time (called: its blocks'
    smallest planned chunk, known once they planned), and with ``host`` (L6) its hidden state and per-row tables in
    host memory between blocks, handed to them as ``HostRows``. Calling it is ``chunk()``."""

    chunk: Callable[[], int]
    host: bool = False

    def __call__(self) -> int:
        return self.chunk()


@dataclass(eq=False)
class HostRows:
    """A whole-sequence tensor kept in host memory (pinned on CUDA) for blocks that compute on ``device`` (L6): a
    model forward hands one to a block whose installed forward takes described inputs (``takes_described``); the
    streamed block reads each chunk's rows back and writes its output rows into it; a stock call gets ``whole()``,
    the rows on the device. ``to()`` leaves it where it is, so hooks that send a call's arguments to the device
    (diffusers' group offloading, accelerate's) do not bring the whole sequence back."""

    tensor: torch.Tensor
    device: torch.device

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def whole(self) -> torch.Tensor:
        """The rows on the compute device (a copy also where host and device are the same memory, as on CPU)."""
        if self.tensor.device == self.device:
            return self.tensor.clone()
        return self.tensor.to(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def part(self, dim: int, start: int, n: int | None) -> torch.Tensor:
        """Rows [start, start + n) along ``dim`` (``n`` None: all of them) on the compute device."""
        return to_compute(self.tensor if n is None else self.tensor.narrow(dim, start, n), self.device)

    def to(self, *args, **kwargs) -> "HostRows":
        return self


def to_compute(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's rows on the compute device: an asynchronous copy from pinned memory on the compute stream (a
    clone where host and device are the same memory, so the copy is a device allocation as on a GPU)."""
    if t.device == device:
        return t.clone()
    return t.to(device, non_blocking=True)


@dataclass(eq=False)
class RowsFrom:
    """A per-row tensor a model forward builds rows of on demand instead of whole: a per-token modulation table from
    runs of equal timesteps (one table row each, picked per row), rotary tables from positions. A block streamed from
    its graph builds each chunk's rows (``make(a, b)``: rows [a, b) along ``dim``, on ``device``); a stock call gets
    ``whole()``. Its rows must be what the whole tensor's rows are: ``make`` is row-local."""

    make: Callable[[int, int], torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    dim: int = 1

    def whole(self) -> torch.Tensor:
        return self.make(0, self.shape[self.dim])

    def part(self, dim: int, start: int, n: int | None) -> torch.Tensor:
        if n is None or dim != self.dim:
            return self.whole()
        return self.make(start, start + n)

    def to(self, *args, **kwargs) -> "RowsFrom":
        return self


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
    per input signature; ``streamplan.graph`` says what it can run and why not)."""

    module: nn.Module
    label: str


@dataclass(eq=False)
class AdaptedCall:
    """A call as a captured graph can take it: an object the graph cannot hold (a KV cache) taken out, and what the
    stock call would have done with it done afterwards from the graph's own K and V ([B, Hkv, N, D]).

    ``held``: where the cache keeps what it is filled with, "device" or "host" (an offloading cache, which also
    brings one other layer's K/V to the device as it is filled). ``host_fill``: fills it from K/V rows in host memory
    taken as they are, no copy (``(k, v, device)``: views of host buffers, the device the layer computes on); None
    where the cache takes device K/V alone (``host_problem`` says why, for a cache held on the host)."""

    args: tuple
    kwargs: dict
    kv_heads: int                                               # the K/V heads ``fill`` expects
    fill: Callable[[torch.Tensor, torch.Tensor], None]
    held: Literal["device", "host"] = "device"
    host_fill: Callable[[torch.Tensor, torch.Tensor, torch.device], None] | None = None
    host_problem: str = ""


@dataclass(eq=False)
class RowMask:
    """An attention mask over a call's own rows (query rows x key rows), described instead of built: a model forward
    passes one in place of the ``[B, 1, N, N]`` tensor its library would build (a padded batch, a sliding window),
    to a layer whose forward takes row masks (``takes_described``). A streamed layer builds each Q chunk's rows
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
    # every key of the call evenly (not only the keys ``span`` gives its chunk)
    blind_rows_see_all: bool = False
    # a flex mask (``attention.flex.FlexMask``) over the call's rows x its ``keys``: the rows, then ``keys - rows``
    # static keys the graph joins after them; attended through the flex consumer, cut to each Q chunk's query blocks
    # (``part`` and ``span`` unused). ``flex_bytes``: its block tables, held through the call
    flex: Any = None
    flex_bytes: int = 0

    def chunk_bytes(self, chunk: int, elem: int, row_bytes: int = 0) -> int:
        """Bytes of one chunk's mask rows at their worst: the bool rows and the kernel's additive copy of them; with
        ``spans``, no mask rows but each batch element's attention output (``row_bytes`` per row) copied in."""
        c = min(chunk, self.rows)
        if self.flex is not None:
            return self.flex_bytes
        if self.spans is not None:
            return c * row_bytes
        keys = min(self.keys, c + self.window - 1) if self.window else self.keys
        return self.batch * c * keys * (1 + elem)


# set on every forward streamplan installs (streamed or watched): how checks and hook chains tell its own links
STREAMED_MARK = "__streamplan_streamed__"
# set on a streamplan forward that takes described inputs (RowMask, HostRows): a block streamed from its captured graph
DESCRIBED_MARK = "_streamplan_takes_described"
# set on a streamplan forward that runs a whole model forward (a ModelSpec): it calls its children one at a time
MODEL_MARK = "_streamplan_model_forward"
DESCRIBED = (RowMask, HostRows, RowsFrom)


def _whole(v):
    if isinstance(v, DESCRIBED):
        return v.whole()
    if isinstance(v, (tuple, list)) and any(isinstance(x, DESCRIBED) for x in v):   # a rotary pair, say
        return type(v)(x.whole() if isinstance(x, DESCRIBED) else x for x in v)
    return v


def described_whole(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with every described argument (``RowMask``, ``HostRows``; also inside a tuple or list) built whole,
    as a stock forward takes it."""
    return tuple(_whole(v) for v in args), {k: _whole(v) for k, v in kwargs.items()}


def address(t: torch.Tensor) -> object:
    """Where a tensor's first element lives, comparable between tensors: its data pointer, or for a fake tensor (a
    rehearsal's, which has no memory) its storage and offset."""
    if type(t) is not torch.Tensor and is_fake(t):   # (a plain tensor is never fake: the common case, checked fast)
        return (t.untyped_storage()._cdata, t.storage_offset() * t.element_size())
    return t.data_ptr()


def storage_address(t: torch.Tensor) -> object:
    """Which memory a tensor views (its storage's data pointer; a fake tensor's storage)."""
    return t.untyped_storage()._cdata if type(t) is not torch.Tensor and is_fake(t) else t.untyped_storage().data_ptr()
