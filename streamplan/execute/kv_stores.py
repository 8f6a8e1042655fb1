"""Where a global attention's whole K and V live between phase KV and phase Q, and attention against them block by
block.

A store is written chunk by chunk in phase KV (``write(start, k, v)``: rows [start, start + n) along the rows
dimension of ``[B, Hkv, rows, D]``) and read back in phase Q, one block of rows at a time, on the compute device
(``blocks(stop)``). Kinds, by registry (``register_kv_store``):

- ``device``: the whole K and V on the device, as stock keeps them (exact; ``whole()`` hands them to the consumer in
  one call);
- ``host``: in pinned host memory on CUDA (plain CPU memory from a separate arena in CPU runs), written out in pieces
  through two small device buffers on a side stream in phase KV and copied back in phase Q to two persistent device
  block buffers in turn on another, so the next block's copy runs under this block's attention (exact). Every
  cross-stream use is ordered by events: a buffer is written only after the compute stream is done with its last
  block (also across Q chunks), a block is read only after its copy, a write buffer is laid out again only after its
  copy out has run;
- ``int8``: on the device, per row and head int8 after a randomized Hadamard rotation of head_dim that spreads
  outlier channels over all of them (approximate, opt-in);
- ``fp8``: on the device, float8 e4m3 with one scale per 128-row tile and head (approximate, opt-in).

A store may hold its rows in ``groups`` groups of K/V heads (the plan's ``head_groups``): phase Q then attends one
group of heads at a time against all its blocks, so the fp32 accumulator and a block's buffers hold that group's heads
alone, and blocks can be that many times longer for the same memory.

``attend_blocks`` attends a Q chunk against a store's blocks through a consumer's ``attend_lse`` and merges the
blocks' partial outputs by their log-sum-exps in fp32 (one cast to the output's dtype at the end): causal chunks
(the diagonal block split at the chunk's first row and attended top-left causal), non-causal, GQA, masks cut per
block; a row that no key of a block may see (log-sum-exp -inf) takes nothing from that block, NaN or not.
"""
from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .call_state import rehearsed, rehearsing
from .host_rows import host_empty
from ..attention.lse_merge import LseAccumulator

KV_KINDS = ("device", "host", "int8", "fp8")
APPROXIMATE = frozenset({"int8", "fp8"})
FP8_TILE = 128          # rows per fp8 scale (per head)
WRITE_ROWS = 2048       # rows per piece a host store's phase KV lays out and copies out (two such buffers)
FP8_MAX = 448.0         # largest finite float8 e4m3fn
INT8_MAX = 127.0


def _rows_first(t: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] -> [n, B, H, D], contiguous: a block of rows is one contiguous range (one copy each way)."""
    return t.permute(2, 0, 1, 3).contiguous()


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[n, B, H, D] view -> [B, H, n, D] view (no copy): the strides of a K that was transposed from [B, n, H, D]."""
    return t.permute(1, 2, 0, 3)


class KVStore:
    """Base of the stores: shape bookkeeping and the block walk; subclasses hold the rows."""

    kind = "device"
    exact = True
    probe: "KVProbe | None" = None   # an approximate store's first call: exact rows attended as they are written

    def __init__(self, device: torch.device, block_rows: int, groups: int = 1, kept: int = 0):
        self.device = torch.device(device)
        self.block_rows = max(1, int(block_rows))
        self.groups = max(1, int(groups))
        self.kept = max(0, int(kept))   # a host store's first rows kept on the device (``HostStore``)
        self.rows = 0
        self.dtype: torch.dtype | None = None
        self.shape: tuple[int, int, int] = (0, 0, 0)   # B, Hkv, D

    def allocate(self, k: torch.Tensor, total: int) -> None:
        B, H, _, D = k.shape
        if H % self.groups:
            raise ValueError(f"{self.groups} head groups do not divide {H} K/V heads")
        self.rows, self.dtype, self.shape = total, k.dtype, (B, H, D)
        self._allocate(total)

    def heads(self, g: int) -> slice:
        """The K/V heads of group ``g``."""
        n = self.shape[1] // self.groups
        return slice(g * n, (g + 1) * n)

    def _allocate(self, total: int) -> None:
        raise NotImplementedError

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Phase KV is done writing."""

    def whole(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole K and V on the device, when the store keeps them so (one consumer call per Q chunk)."""
        return None

    def block(self, a: int, b: int, g: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [a, b) of head group ``g``'s K and V on the device, [B, Hkv / groups, b - a, D]."""
        raise NotImplementedError

    def blocks(self, stop: int, g: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, K block, V block) of head group ``g`` on the device, covering rows [0, stop)."""
        for a in rehearsed(list(range(0, stop, self.block_rows))):
            b = min(a + self.block_rows, stop)
            k, v = self.block(a, b, g)
            yield a, k, v

    def device_bytes(self) -> int:
        """Bytes this store keeps on the compute device between the phases."""
        return 0

    def host_bytes(self) -> int:
        return 0

    def host_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row's K and V as ``[B, Hkv, rows, D]`` views of host memory, or None where the store holds them
        otherwise (what a cache that keeps K/V on the host takes as they are)."""
        return None

    def release(self) -> None:
        pass


class DeviceStore(KVStore):
    """The default: the whole K and V on the device."""

    kind = "device"

    def _allocate(self, total: int) -> None:
        B, H, D = self.shape
        self.k = _heads_first(torch.empty(total, B, H, D, dtype=self.dtype, device=self.device))
        self.v = _heads_first(torch.empty(total, B, H, D, dtype=self.dtype, device=self.device))

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        self.k[:, :, start:start + n].copy_(k)
        self.v[:, :, start:start + n].copy_(v)

    def whole(self):
        return self.k, self.v

    def block(self, a: int, b: int, g: int = 0):
        h = self.heads(g)
        return self.k[:, h, a:b], self.v[:, h, a:b]

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def release(self) -> None:
        self.k = self.v = None


class HostStore(KVStore):
    """K and V in host memory, laid out ``[groups, rows, B, Hkv / groups, D]`` so that a block of one head group is one
    contiguous range (one copy each way); blocks come back through ``_Staging``'s two device buffers.

    ``kept``: the first rows of every head group stay on the device (as ``DeviceStore`` keeps them all), the rest go
    to the host: a budget with room for part of K/V copies only the rest back each pass. The first rows, because a
    causal pass reads up to its last query row: every pass reads them."""

    kind = "host"

    def _allocate(self, total: int) -> None:
        B, H, D = self.shape
        G = self.groups
        self.cuda = self.device.type == "cuda"
        self.staging: _Staging | None = None
        self.keep = min(self.kept, total)
        shape = (G, total - self.keep, B, H // G, D)
        kept = (G, self.keep, B, H // G, D)
        self.dk = torch.empty(kept, dtype=self.dtype, device=self.device) if self.keep else None
        self.dv = torch.empty(kept, dtype=self.dtype, device=self.device) if self.keep else None
        if self.device.type == "meta" and not rehearsing():   # planning a lone block on meta tensors: shapes only
            self.hk = torch.empty(shape, dtype=self.dtype, device="meta")
            self.hv = torch.empty(shape, dtype=self.dtype, device="meta")
            return
        self.hk = host_empty(shape, self.dtype, self.device)   # pinned on CUDA; fake host tensors in a rehearsal
        self.hv = host_empty(shape, self.dtype, self.device)
        if self.cuda:
            self._start_writer()

    def _start_writer(self) -> None:
        """Phase KV's copies out run on a stream of their own, beside the next chunk's projections."""
        self.writer = torch.cuda.Stream(self.device)
        self._wbufs: list[torch.Tensor] = []
        # events recorded again for each piece (``_Staging`` says why that is safe): a buffer's copy out done,
        # whether it has been recorded yet, and a piece laid out
        self._wdone = [torch.cuda.Event(), torch.cuda.Event()]
        self._wused = [False, False]
        self._laid_out = torch.cuda.Event()
        self._wj = 1

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        cut = min(max(self.keep - start, 0), n)   # of these rows, those kept on the device
        if cut:
            for t, dev in ((k, self.dk), (v, self.dv)):
                for g in range(self.groups):
                    dev[g, start:start + cut].copy_(t[:, self.heads(g), :cut].permute(2, 0, 1, 3))
        if cut < n:
            self._write_host(start + cut - self.keep, k[:, :, cut:], v[:, :, cut:])

    def _write_host(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows [start, start + n) of the host rows."""
        n = k.shape[2]
        if not self.cuda:
            for t, host in ((k, self.hk), (v, self.hv)):
                for g in range(self.groups):
                    host[g, start:start + n].copy_(_rows_first(t[:, self.heads(g)]))
            return
        # in pieces of rows through two device buffers in turn: the compute stream lays a piece out rows-first, the
        # writer stream copies it out while the compute stream goes on; a buffer is laid out again only after its
        # copy out has run, so phase KV holds two pieces more than stock, whatever the chunk
        compute = torch.cuda.current_stream(self.device)
        if not self._wbufs:
            B, H, D = self.shape
            self._wbufs = [torch.empty(2, WRITE_ROWS, B, H // self.groups, D, dtype=self.dtype, device=self.device)
                           for _ in range(2)]
        for g in range(self.groups):
            h = self.heads(g)
            for r in rehearsed(list(range(0, n, WRITE_ROWS))):
                m = min(WRITE_ROWS, n - r)
                j = self._wj = 1 - self._wj
                if self._wused[j]:
                    compute.wait_event(self._wdone[j])
                buf = self._wbufs[j]
                buf[0, :m].copy_(k[:, h, r:r + m].permute(2, 0, 1, 3))
                buf[1, :m].copy_(v[:, h, r:r + m].permute(2, 0, 1, 3))
                self._laid_out.record(compute)
                with on_stream(self.writer, compute):
                    self.writer.wait_event(self._laid_out)
                    self.hk[g, start + r:start + r + m].copy_(buf[0, :m], non_blocking=True)
                    self.hv[g, start + r:start + r + m].copy_(buf[1, :m], non_blocking=True)
                    self._wdone[j].record(self.writer)
                    self._wused[j] = True

    def finish(self) -> None:
        if self.cuda:
            self._written = self.writer.record_event()
            for buf in self._wbufs:   # freed now, handed out again only once the copies out have read them
                buf.record_stream(self.writer)
            self._wbufs, self._wused = [], [False, False]

    def block(self, a: int, b: int, g: int = 0):   # CPU: the host rows are the device rows (views, no copy)
        if b <= self.keep:
            return _heads_first(self.dk[g, a:b]), _heads_first(self.dv[g, a:b])
        a, b = a - self.keep, b - self.keep
        return _heads_first(self.hk[g, a:b]), _heads_first(self.hv[g, a:b])

    def _bounds(self, stop: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The blocks of rows [0, stop): those kept on the device, then those on the host (host rows, from 0)."""
        n, keep = self.block_rows, min(self.keep, stop)
        kept = [(a, min(a + n, keep)) for a in range(0, keep, n)]
        return kept, [(a, min(a + n, stop - self.keep)) for a in range(0, stop - self.keep, n)]

    def blocks(self, stop: int, g: int = 0):
        kept, host = (rehearsed(b) for b in self._bounds(stop))
        if not self.cuda:
            for a, b in [*kept, *((a + self.keep, b + self.keep) for a, b in host)]:
                yield (a, *self.block(a, b, g))
            return
        if self.staging is None:
            self.staging = _Staging(self)
        if kept and host:   # the first host block's copy queued before the kept blocks' attention, to run under it
            self.staging.fetch(g, *host[0])
        for a, b in kept:
            yield a, _heads_first(self.dk[g, a:b]), _heads_first(self.dv[g, a:b])
        if host:
            for a, k, v in self.staging.blocks(host, g):
                yield a + self.keep, k, v

    def device_bytes(self) -> int:
        return 2 * self.dk.numel() * self.dk.element_size() if self.dk is not None else 0

    def host_bytes(self) -> int:
        return 2 * self.hk.numel() * self.hk.element_size()

    def host_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """In one head group with no rows kept on the device, the host rows as ``[B, Hkv, rows, D]`` views (they
        outlive ``release`` where held; on CUDA written on a side stream: ``wait_written``). None otherwise: a group's
        heads are not a slice of one such view, and kept rows are not on the host."""
        if self.groups != 1 or self.keep or self.hk is None or self.hk.device.type == "meta":
            return None
        return _heads_first(self.hk[0]), _heads_first(self.hv[0])

    def wait_written(self) -> None:
        """The current stream waits for phase KV's copies out (after ``finish``, also once released): what reads the
        host rows after it sees them whole."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._written)

    def release(self) -> None:
        if self.staging is not None:
            self.staging.close()
        self.hk = self.hv = self.dk = self.dv = self.staging = None


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream", current: "torch.cuda.Stream") -> Iterator[None]:
    """``stream`` current inside, ``current`` (the stream current now, which the caller knows) after. Cheaper in host
    time than ``torch.cuda.stream``, whose device lookups cost more than a block's copies' enqueue: this runs once a
    block of a store's pass. On another device than the current one, ``torch.cuda.stream`` itself."""
    if torch.cuda.current_device() != stream.device_index:
        with torch.cuda.stream(stream):
            yield
        return
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(current)


class _Staging:
    """Two device block buffers, filled in turn on a side stream from a ``HostStore``'s host rows and kept for the whole
    of phase Q, so that the copy of the next block (and, at the end of a pass, the first block of the next pass: the
    next head group's, or the next Q chunk's) runs while the compute stream attends this one.

    Ordering, by events: a buffer is written (copier stream) only after the compute stream has recorded that it is done
    with the block last handed out from it (``done``), whichever pass that was; a block is handed out only after the
    compute stream waits for its copy (``ready``); the copier starts after phase KV's copies out (``_written``) and
    after the buffers' allocation on the compute stream. The compute stream is the one current when the staging is
    made, which all of phase Q runs on: each copy is queued with the copier made current and that stream current
    again after (``on_stream``)."""

    def __init__(self, store: HostStore):
        self.store = store
        B, H, D = store.shape
        n = min(store.block_rows, store.rows - store.keep)
        dev, dt = store.device, store.dtype
        self.compute = torch.cuda.current_stream(dev)
        self.copier = torch.cuda.Stream(dev)
        self.bufs = [(torch.empty(n, B, H // store.groups, D, dtype=dt, device=dev),
                      torch.empty(n, B, H // store.groups, D, dtype=dt, device=dev)) for _ in range(2)]
        self.copier.wait_stream(self.compute)          # the buffers' memory: whatever the compute stream did with it
        self.copier.wait_event(store._written)
        # one event per buffer and side, recorded again for each block: a wait queued on an event waits for the
        # record before it, so a later record never moves an earlier wait (and a block step makes no new events)
        self.done = [torch.cuda.Event(), torch.cuda.Event()]
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]                     # whether a buffer's ``done`` has been recorded yet
        self.held: list[tuple[int, int, int] | None] = [None, None]   # (group, a, b) each buffer holds or will
        self.last = 1                                  # the buffer written last; the next copy goes to the other

    def fetch(self, g: int, a: int, b: int) -> int:
        """The buffer that holds (or will hold, once ``ready``) rows [a, b) of group ``g``: a copy queued now, unless
        the last copy queued was this very block (the prefetch at the end of a pass)."""
        if self.held[self.last] == (g, a, b):
            return self.last
        j = self.last = 1 - self.last
        st = self.store
        self.held[j] = (g, a, b)
        with on_stream(self.copier, self.compute):
            if self.used[j]:
                self.copier.wait_event(self.done[j])
            self.bufs[j][0][:b - a].copy_(st.hk[g, a:b], non_blocking=True)
            self.bufs[j][1][:b - a].copy_(st.hv[g, a:b], non_blocking=True)
            self.ready[j].record(self.copier)
        return j

    def blocks(self, bounds: list[tuple[int, int]], g: int):
        """Group ``g``'s host rows in ``bounds`` (host rows: a store's kept rows are not among them), each block
        handed out once its copy has run."""
        st = self.store
        # after this pass: the next group's first block, or (after the last group) the first group's, for the next Q
        # chunk (a causal chunk's first block has the same rows once chunks are a block long)
        after = ((g + 1) % st.groups, 0, min(st.block_rows, st.rows - st.keep))
        j = self.fetch(g, *bounds[0])
        for i, (a, b) in enumerate(bounds):
            nxt = self.fetch(g, *bounds[i + 1]) if i + 1 < len(bounds) else None
            if nxt is None:
                self.fetch(*after)
            self.compute.wait_event(self.ready[j])
            try:
                yield a, _heads_first(self.bufs[j][0][:b - a]), _heads_first(self.bufs[j][1][:b - a])
            finally:   # also when the attention stops early: its reads are queued before this event
                self.done[j].record(self.compute)
                self.used[j] = True
            j = nxt

    def close(self) -> None:
        """The compute stream (which frees the buffers) waits for every copy into them."""
        self.compute.wait_stream(self.copier)
        self.bufs = []


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """An orthonormal rotation of ``n`` channels: a normalized Hadamard matrix with fixed random signs per channel
    (randomized Hadamard) when ``n`` is a power of two, else a fixed random orthogonal matrix."""
    gen = torch.Generator().manual_seed(0x5EED)
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    if n & (n - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / math.sqrt(n)
    else:
        r, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    return (signs.unsqueeze(1) * r).to(device)


class Int8Store(KVStore):
    """Rotated int8: each row of each head is rotated (orthonormal, spreading outlier channels), then scaled by its own
    max to int8; a block is scaled back and rotated back in fp32. About half of bf16 K/V at head_dim 128."""

    kind = "int8"
    exact = False

    def _allocate(self, total: int) -> None:
        B, H, D = self.shape
        self.rot = _hadamard(D, self.device)
        self.q = [torch.empty(total, B, H, D, dtype=torch.int8, device=self.device) for _ in range(2)]
        self.s = [torch.empty(total, B, H, 1, dtype=torch.float32, device=self.device) for _ in range(2)]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        for i, t in enumerate((k, v)):
            r = torch.matmul(_rows_first(t).float(), self.rot)
            scale = r.abs().amax(-1, keepdim=True).clamp_min(1e-30) / INT8_MAX
            self.q[i][start:start + n] = torch.round(r / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            self.s[i][start:start + n] = scale

    def block(self, a: int, b: int, g: int = 0):
        h = self.heads(g)
        out = []
        for i in range(2):
            x = self.q[i][a:b, :, h].float().mul_(self.s[i][a:b, :, h])
            x = torch.matmul(x, self.rot.T)
            out.append(_heads_first(x.to(self.dtype)))
        return out[0], out[1]

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.q + self.s)

    def release(self) -> None:
        self.q = self.s = None


class Fp8Store(KVStore):
    """float8 e4m3 with one fp32 scale per tile of ``FP8_TILE`` rows (counted from each write's first row) and head."""

    kind = "fp8"
    exact = False

    def _allocate(self, total: int) -> None:
        B, H, D = self.shape
        self.q = [torch.empty(total, B, H, D, dtype=torch.float8_e4m3fn, device=self.device) for _ in range(2)]
        self.tiles: list[tuple[int, torch.Tensor, torch.Tensor]] = []   # (first row, K scale, V scale) [1, B, H, 1]
        self._index: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        for t0 in range(0, n, FP8_TILE):
            t1 = min(t0 + FP8_TILE, n)
            scales = []
            for i, t in enumerate((k, v)):
                r = _rows_first(t[:, :, t0:t1]).float()
                scale = r.abs().amax(dim=(0, 3), keepdim=True).clamp_min(1e-30) / FP8_MAX
                self.q[i][start + t0:start + t1] = (r / scale).to(torch.float8_e4m3fn)
                scales.append(scale)
            self.tiles.append((start + t0, scales[0], scales[1]))
        self._index = None

    def finish(self) -> None:
        self.tiles.sort(key=lambda t: t[0])
        starts = [t[0] for t in self.tiles]
        self._index = (starts, torch.cat([t[1] for t in self.tiles]), torch.cat([t[2] for t in self.tiles]))

    def block(self, a: int, b: int, g: int = 0):
        h = self.heads(g)
        if self._index is None:
            self.finish()
        starts, ks, vs = self._index
        lo, hi = bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b)
        edges = torch.tensor(starts[lo:hi], device=self.device)
        which = torch.searchsorted(edges, torch.arange(a, b, device=self.device), right=True) - 1 + lo
        out = []
        for i, scales in enumerate((ks, vs)):
            x = self.q[i][a:b, :, h].float().mul_(scales[which][:, :, h])
            out.append(_heads_first(x.to(self.dtype)))
        return out[0], out[1]

    def device_bytes(self) -> int:
        return sum(t.numel() for t in self.q) + 8 * len(self.tiles) * self.shape[0] * self.shape[1]

    def release(self) -> None:
        self.q, self.tiles, self._index = None, [], None


@dataclass(frozen=True)
class StoreKind:
    """A registered store: how to make one, and its memory model for the planner (bytes per K/V element kept on the
    device, and whether the rows live on the host)."""

    factory: Callable[..., KVStore]   # (device, block rows, head groups, rows kept on the device)
    exact: bool
    resident: Callable[[int, int], float]   # (elem bytes, head_dim) -> device bytes kept per K/V element
    on_host: bool = False
    keeps_rows: bool = False   # can keep its first rows on the device (``HostStore.kept``)


_STORES: dict[str, StoreKind] = {}


def register_kv_store(kind: str, store: StoreKind) -> None:
    _STORES[kind] = store


def store_kind(kind: str) -> StoreKind:
    return _STORES[kind]


def make_store(kind: str, device: torch.device, block_rows: int, groups: int = 1, kept: int = 0) -> KVStore:
    """A store of ``kind``; ``kept``: its first rows kept on the device (a kind that can: ``StoreKind.keeps_rows``)."""
    if kept and not _STORES[kind].keeps_rows:
        raise ValueError(f"a {kind} K/V store keeps no rows apart on the device (kept={kept})")
    return _STORES[kind].factory(device, block_rows, groups, kept)


register_kv_store("device", StoreKind(DeviceStore, True, lambda e, d: float(e)))
register_kv_store("host", StoreKind(HostStore, True, lambda e, d: 0.0, on_host=True, keeps_rows=True))
register_kv_store("int8", StoreKind(Int8Store, False, lambda e, d: 1.0 + 4.0 / d))
register_kv_store("fp8", StoreKind(Fp8Store, False, lambda e, d: 1.0 + 8.0 / (d * FP8_TILE)))


def write_rows(store: KVStore, k: torch.Tensor, v: torch.Tensor, pre: int, post: int, total: int, a: int, b: int,
               first: bool) -> None:
    """A phase-KV chunk (dynamic rows [a, b), with the static rows around them on the first chunk) into the store,
    as ``graph_run._write_rows`` does into a whole buffer."""
    if first and store.rows == 0:
        store.allocate(k, pre + total + post)

    def put(start: int, kk: torch.Tensor, vv: torch.Tensor) -> None:
        store.write(start, kk, vv)
        probe = getattr(store, "probe", None)   # an approximate store's error check (a sequence-parallel one has none)
        if probe is not None:   # the exact rows, before they are compressed and let go
            probe.add(start, kk, vv)

    off = pre if first else 0
    put(pre + a, k[:, :, off:off + b - a], v[:, :, off:off + b - a])
    if first and pre:
        put(0, k[:, :, :pre], v[:, :, :pre])
    if first and post:
        put(pre + total, k[:, :, pre + b - a:pre + b - a + post], v[:, :, pre + b - a:pre + b - a + post])


def attend_blocks(consumer: Any, q: torch.Tensor, store: KVStore, *, q_offset: int, causal: bool,
                  scale: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Q chunk [B, H, c, D] (rows ``q_offset`` .. ``q_offset + c``) against a store's K/V, head group by head group,
    block by block, through ``consumer.attend_lse``; exact up to summation order. ``mask``: [.., c, keys] over all the
    store's rows."""
    if q.device.type == "meta":   # planning on meta tensors (``streamplan plan``): shapes only
        return torch.empty_like(q)
    whole = store.whole()
    if whole is not None and mask is None:
        return consumer.attend(q, whole[0], whole[1], q_offset=q_offset, causal=causal, mask=None, scale=scale)
    H = q.shape[1]
    G = store.groups
    if H % G:
        raise ValueError(f"{G} head groups do not divide {H} query heads")
    if G == 1:
        return _attend_group(consumer, q, store, 0, q_offset, causal, scale, mask).result(q.dtype)
    out = torch.empty_like(q)
    hq = H // G
    for g in range(G):
        h = slice(g * hq, (g + 1) * hq)
        m = mask[..., h, :, :] if mask is not None and mask.dim() >= 3 and mask.shape[-3] == H else mask
        _attend_group(consumer, q[:, h], store, g, q_offset, causal, scale, m).result(q.dtype, out[:, h])
    return out


def _attend_group(consumer: Any, q: torch.Tensor, store: KVStore, g: int, q_offset: int, causal: bool,
                  scale: float | None, mask: torch.Tensor | None) -> LseAccumulator:
    """Head group ``g``'s query heads against its K/V blocks, merged."""
    c = q.shape[2]
    stop = min(store.rows, q_offset + c) if causal else store.rows
    merge = LseAccumulator(q)
    for s, k, v in store.blocks(stop, g):
        attend_rows(consumer, q, s, k, v, merge, q_offset, causal, scale, mask)
        del k, v
    return merge


def attend_rows(consumer: Any, q: torch.Tensor, s: int, k: torch.Tensor, v: torch.Tensor, merge: LseAccumulator,
                q_offset: int, causal: bool, scale: float | None, mask: torch.Tensor | None = None) -> None:
    """Q rows ``q_offset``.. against K/V rows [s, s + n) of the store's rows, merged into ``merge``; causal: the keys
    past the last query row left out, the diagonal attended top-left causal."""
    if causal:
        stop = q_offset + q.shape[2]
        if s >= stop:
            return
        if s + k.shape[2] > stop:
            k, v = k[:, :, :stop - s], v[:, :, :stop - s]
    e = s + k.shape[2]
    cut = q_offset - s if causal and s < q_offset < e else (0 if causal and s >= q_offset else k.shape[2])
    if cut > 0:   # keys every row of the chunk sees whole
        m = mask[..., s:s + cut] if mask is not None else None
        o, lse = consumer.attend_lse(q, k[:, :, :cut], v[:, :, :cut], causal=False, mask=m, scale=scale)
        merge.add(o, lse, masked=m is not None)
        del o, lse   # merged: let go before the diagonal's call (one partial output at a time, as the model counts)
    if cut < k.shape[2]:   # keys on the chunk's diagonal: row r0 + i sees keys ds .. ds + i
        ds = s + cut
        r0 = ds - q_offset
        m = mask[..., r0:, ds:e] if mask is not None else None
        o, lse = consumer.attend_lse(q[:, :, r0:], k[:, :, cut:], v[:, :, cut:], causal=True, mask=m, scale=scale)
        merge.add(o, lse, r0, masked=m is not None)


class KVProbe:
    """An approximate store's error, checked in a chunk's memory: a few query rows (``q``, at ``q_offset``) attended
    against the exact K/V rows as phase KV writes them (``add``: each written piece merged by log-sum-exp, then let
    go, so exact K/V are never held whole), then against the store (``error``). Their difference is the compression's
    error where it enters the block, at a fraction of a chunk's attention in time and its query rows in memory."""

    def __init__(self, consumer: Any, q: torch.Tensor, q_offset: int, causal: bool, scale: float | None,
                 groups: int = 1, block_rows: int = 0):
        H = q.shape[1]
        self.consumer, self.q_offset, self.causal, self.scale = consumer, q_offset, causal, scale
        self.groups = max(1, groups)
        hq = H // self.groups
        self.qs = [q[:, g * hq:(g + 1) * hq] for g in range(self.groups)]
        self.block_rows = max(1, block_rows or q.shape[2])
        self.merges = [LseAccumulator(qg) for qg in self.qs]

    @property
    def rows(self) -> int:
        return self.qs[0].shape[2]

    def nbytes(self) -> int:
        """What the probe holds through phase KV: its query rows and their fp32 accumulators."""
        return sum(t.numel() * t.element_size() for qg, m in zip(self.qs, self.merges) for t in (qg, m.acc, m.lse))

    def add(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Exact K/V rows [start, start + n), [B, Hkv, n, D]: attended now, a head group and a block at a time."""
        hk = k.shape[1] // self.groups
        for a in range(0, k.shape[2], self.block_rows):
            b = min(a + self.block_rows, k.shape[2])
            for g, (qg, merge) in enumerate(zip(self.qs, self.merges)):
                attend_rows(self.consumer, qg, start + a, k[:, g * hk:(g + 1) * hk, a:b],
                            v[:, g * hk:(g + 1) * hk, a:b], merge, self.q_offset, self.causal, self.scale)

    def error(self, store: KVStore) -> dict[str, float]:
        """``{"max_abs", "rel", "nan_mismatch"}`` of the same rows attended against ``store`` (held in the probe's
        head groups), in fp32 both, over every head."""
        from .compare import compare_outputs
        if store.groups != self.groups:
            raise ValueError(f"a probe in {self.groups} head groups checks a store in as many, not {store.groups}")
        got = torch.cat([_attend_group(self.consumer, qg, store, g, self.q_offset, self.causal, self.scale, None)
                         .result(torch.float32) for g, qg in enumerate(self.qs)], 1)
        exact = torch.cat([m.result(torch.float32) for m in self.merges], 1)
        return compare_outputs(got, exact)["output"]

    def release(self) -> None:
        self.qs, self.merges = [], []


__all__ = ["KV_KINDS", "APPROXIMATE", "KVStore", "DeviceStore", "HostStore", "Int8Store", "Fp8Store", "StoreKind",
           "register_kv_store", "store_kind", "make_store", "write_rows", "attend_blocks", "attend_rows", "KVProbe"]
