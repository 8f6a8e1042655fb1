"""Where a global attention's whole K and V live between phase KV and phase Q, and attention against them block by
block.

A store is written chunk by chunk in phase KV (``write(start, k, v)``: rows [start, start + n) along the rows
dimension of ``[B, Hkv, rows, D]``) and read back in phase Q, one block of rows at a time, on the compute device
(``blocks(stop)``). Kinds, by registry (``register_kv_store``):

- ``device``: the whole K and V as they are today (exact; ``whole()`` hands them to the consumer in one call);
- ``host``: in pinned host memory on CUDA (plain CPU memory from a separate arena in CPU runs), copied back to two
  device block buffers in turn on a side stream, so the next block's copy runs under this block's attention (exact);
- ``int8``: on the device, per row and head int8 after a randomized Hadamard rotation of head_dim that spreads
  outlier channels over all of them (approximate, opt-in);
- ``fp8``: on the device, float8 e4m3 with one scale per 128-row tile and head (approximate, opt-in).

``attend_blocks`` attends a Q chunk against a store's blocks through a consumer's ``attend_lse`` and merges the
blocks' partial outputs by their log-sum-exps in fp32: causal chunks (the diagonal block split at the chunk's first
row and attended top-left causal), non-causal, GQA, masks sliced per block.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

KV_KINDS = ("device", "host", "int8", "fp8")
APPROXIMATE = frozenset({"int8", "fp8"})
FP8_TILE = 128          # rows per fp8 scale (per head)
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

    def __init__(self, device: torch.device, block_rows: int):
        self.device = torch.device(device)
        self.block_rows = max(1, int(block_rows))
        self.rows = 0
        self.dtype: torch.dtype | None = None
        self.shape: tuple[int, int, int] = (0, 0, 0)   # B, Hkv, D

    def allocate(self, k: torch.Tensor, total: int) -> None:
        B, H, _, D = k.shape
        self.rows, self.dtype, self.shape = total, k.dtype, (B, H, D)
        self._allocate(total)

    def _allocate(self, total: int) -> None:
        raise NotImplementedError

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Phase KV is done writing."""

    def whole(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole K and V on the device, when the store keeps them so (one consumer call per Q chunk)."""
        return None

    def block(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def blocks(self, stop: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, K block, V block) on the device, [B, Hkv, n, D], covering rows [0, stop)."""
        for a in range(0, stop, self.block_rows):
            b = min(a + self.block_rows, stop)
            k, v = self.block(a, b)
            yield a, k, v

    def device_bytes(self) -> int:
        """Bytes this store keeps on the compute device between the phases."""
        return 0

    def host_bytes(self) -> int:
        return 0

    def release(self) -> None:
        pass


class DeviceStore(KVStore):
    """Today's buffers: the whole K and V on the device."""

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

    def block(self, a: int, b: int):
        return self.k[:, :, a:b], self.v[:, :, a:b]

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def release(self) -> None:
        self.k = self.v = None


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Host memory for K/V. On CUDA: pinned (page-locked), so copies run asynchronously at full bandwidth. In a CPU run
    the "device" is the host too: the rows come from numpy's allocator, an arena apart from torch's CPU allocator (which
    the meter watches there as the CUDA allocator is watched on a GPU), so tests see what stays on the device side."""
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    import numpy as np
    raw = torch.from_numpy(np.empty(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    return raw.view(dtype).view(shape)


class HostStore(KVStore):
    """K and V in host memory; blocks come back through two device buffers in turn, copied on a side stream."""

    kind = "host"

    def _allocate(self, total: int) -> None:
        B, H, D = self.shape
        self.cuda = self.device.type == "cuda"
        if self.device.type == "meta":   # planning on meta tensors: shapes only
            self.hk = torch.empty(total, B, H, D, dtype=self.dtype, device="meta")
            self.hv = torch.empty(total, B, H, D, dtype=self.dtype, device="meta")
            return
        self.hk = _host_empty((total, B, H, D), self.dtype, self.cuda)
        self.hv = _host_empty((total, B, H, D), self.dtype, self.cuda)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        # on CUDA the copy is queued on the current stream: the chunk's K and V are not reused before it has run
        self.hk[start:start + n].copy_(_rows_first(k), non_blocking=self.cuda)
        self.hv[start:start + n].copy_(_rows_first(v), non_blocking=self.cuda)

    def finish(self) -> None:
        if self.cuda:
            self._written = torch.cuda.current_stream(self.device).record_event()

    def block(self, a: int, b: int):   # CPU: the host rows are the device rows (views, no copy)
        return _heads_first(self.hk[a:b]), _heads_first(self.hv[a:b])

    def blocks(self, stop: int):
        if not self.cuda:
            yield from super().blocks(stop)
            return
        yield from _double_buffered(self, stop)

    def host_bytes(self) -> int:
        return 2 * self.hk.numel() * self.hk.element_size()

    def release(self) -> None:
        self.hk = self.hv = None


def _double_buffered(store: HostStore, stop: int):
    """Blocks copied host -> device on a side stream into two buffers in turn: block i+1's copy is queued before block
    i is handed out, and a buffer is written again only after the compute stream has finished with it."""
    B, H, D = store.shape
    compute = torch.cuda.current_stream(store.device)
    copier = store.copier = getattr(store, "copier", None) or torch.cuda.Stream(store.device)
    copier.wait_event(store._written)
    n = min(store.block_rows, stop)
    bufs = [(torch.empty(n, B, H, D, dtype=store.dtype, device=store.device),
             torch.empty(n, B, H, D, dtype=store.dtype, device=store.device)) for _ in range(2 if stop > n else 1)]
    done: list[Any] = [None] * len(bufs)
    ready: list[Any] = [None] * len(bufs)
    starts = list(range(0, stop, store.block_rows))

    def issue(i: int) -> None:
        a = starts[i]
        b = min(a + store.block_rows, stop)
        j = i % len(bufs)
        with torch.cuda.stream(copier):
            if done[j] is not None:
                copier.wait_event(done[j])
            bufs[j][0][:b - a].copy_(store.hk[a:b], non_blocking=True)
            bufs[j][1][:b - a].copy_(store.hv[a:b], non_blocking=True)
            ready[j] = copier.record_event()

    issue(0)
    try:
        for i, a in enumerate(starts):
            if i + 1 < len(starts):
                issue(i + 1)
            j = i % len(bufs)
            compute.wait_event(ready[j])
            b = min(a + store.block_rows, stop)
            yield a, _heads_first(bufs[j][0][:b - a]), _heads_first(bufs[j][1][:b - a])
            done[j] = compute.record_event()
    finally:   # left early (an error in the attention): no copy may still write a buffer the allocator reuses
        compute.wait_stream(copier)


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

    def block(self, a: int, b: int):
        out = []
        for i in range(2):
            x = self.q[i][a:b].float().mul_(self.s[i][a:b])
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

    def block(self, a: int, b: int):
        if self._index is None:
            self.finish()
        starts, ks, vs = self._index
        lo, hi = bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b)
        edges = torch.tensor(starts[lo:hi], device=self.device)
        which = torch.searchsorted(edges, torch.arange(a, b, device=self.device), right=True) - 1 + lo
        out = []
        for i, scales in enumerate((ks, vs)):
            x = self.q[i][a:b].float().mul_(scales[which])
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

    factory: Callable[[torch.device, int], KVStore]
    exact: bool
    resident: Callable[[int, int], float]   # (elem bytes, head_dim) -> device bytes kept per K/V element
    on_host: bool = False


_STORES: dict[str, StoreKind] = {}


def register_kv_store(kind: str, store: StoreKind) -> None:
    _STORES[kind] = store


def store_kind(kind: str) -> StoreKind:
    return _STORES[kind]


def make_store(kind: str, device: torch.device, block_rows: int) -> KVStore:
    return _STORES[kind].factory(device, block_rows)


register_kv_store("device", StoreKind(DeviceStore, True, lambda e, d: float(e)))
register_kv_store("host", StoreKind(HostStore, True, lambda e, d: 0.0, on_host=True))
register_kv_store("int8", StoreKind(Int8Store, False, lambda e, d: 1.0 + 4.0 / d))
register_kv_store("fp8", StoreKind(Fp8Store, False, lambda e, d: 1.0 + 8.0 / (d * FP8_TILE)))


def write_rows(store: KVStore, k: torch.Tensor, v: torch.Tensor, pre: int, post: int, total: int, a: int, b: int,
               first: bool) -> None:
    """A phase-KV chunk (dynamic rows [a, b), with the static rows around them on the first chunk) into the store,
    as ``capture.execute._write_rows`` does into a whole buffer."""
    if first and store.rows == 0:
        store.allocate(k, pre + total + post)
    off = pre if first else 0
    store.write(pre + a, k[:, :, off:off + b - a], v[:, :, off:off + b - a])
    if first and pre:
        store.write(0, k[:, :, :pre], v[:, :, :pre])
    if first and post:
        store.write(pre + total, k[:, :, pre + b - a:pre + b - a + post], v[:, :, pre + b - a:pre + b - a + post])


class _Merge:
    """Partial attention outputs merged by their log-sum-exps, in fp32."""

    def __init__(self, q: torch.Tensor):
        B, H, c, D = q.shape
        self.acc = torch.zeros(B, H, c, D, dtype=torch.float32, device=q.device)
        self.lse = torch.full((B, H, c), float("-inf"), dtype=torch.float32, device=q.device)
        self.spare: torch.Tensor | None = None   # a whole-chunk partial output, reused for the result

    def add(self, o: torch.Tensor, lse: torch.Tensor, r0: int = 0) -> None:
        acc, old = self.acc[:, :, r0:], self.lse[:, :, r0:]
        lse = lse.float()
        new = torch.logaddexp(old, lse)
        safe = torch.where(torch.isinf(new), 0.0, new)
        a = torch.exp(old - safe).unsqueeze(-1)
        w = torch.exp(lse - safe).unsqueeze(-1)
        acc.mul_(a).addcmul_(o, w)
        old.copy_(new)
        if r0 == 0 and o.shape == self.acc.shape and o.is_contiguous():
            self.spare = o

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.float32:
            return self.acc
        if self.spare is not None and self.spare.dtype == dtype:
            return self.spare.copy_(self.acc)
        return self.acc.to(dtype)


def attend_blocks(consumer: Any, q: torch.Tensor, store: KVStore, *, q_offset: int, causal: bool,
                  scale: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Q chunk [B, H, c, D] (rows ``q_offset`` .. ``q_offset + c``) against a store's K/V, block by block, through
    ``consumer.attend_lse``; exact up to summation order. ``mask``: [.., c, keys] over all the store's rows."""
    if q.device.type == "meta":   # planning on meta tensors (``streamplan plan``): shapes only
        return torch.empty_like(q)
    whole = store.whole()
    if whole is not None and mask is None:
        return consumer.attend(q, whole[0], whole[1], q_offset=q_offset, causal=causal, mask=None, scale=scale)
    c = q.shape[2]
    stop = min(store.rows, q_offset + c) if causal else store.rows
    merge = _Merge(q)
    for s, k, v in store.blocks(stop):
        e = s + k.shape[2]
        cut = q_offset - s if causal and s < q_offset < e else (0 if causal and s >= q_offset else k.shape[2])
        if cut > 0:   # keys every row of the chunk sees whole
            m = mask[..., s:s + cut] if mask is not None else None
            o, lse = consumer.attend_lse(q, k[:, :, :cut], v[:, :, :cut], causal=False, mask=m, scale=scale)
            merge.add(o, lse)
        if cut < k.shape[2]:   # keys on the chunk's diagonal: row r0 + i sees keys ds .. ds + i
            ds = s + cut
            r0 = ds - q_offset
            m = mask[..., r0:, ds:e] if mask is not None else None
            o, lse = consumer.attend_lse(q[:, :, r0:], k[:, :, cut:], v[:, :, cut:], causal=True, mask=m, scale=scale)
            merge.add(o, lse, r0)
        del k, v
    return merge.result(q.dtype)


__all__ = ["KV_KINDS", "APPROXIMATE", "KVStore", "DeviceStore", "HostStore", "Int8Store", "Fp8Store", "StoreKind",
           "register_kv_store", "store_kind", "make_store", "write_rows", "attend_blocks"]
