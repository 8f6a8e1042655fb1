"""Attention under sequence parallelism (Ulysses): each rank holds N/P rows of every block, and attention needs every
row. The block streams on its own rows as on one device; only its global attentions see the other ranks:

- phase KV: each chunk's K and V ([B, H, n, D], this rank's rows) are exchanged all-to-all as they are made: every
  rank sends heads group j to rank j and receives the same rows of its own H/P heads from every rank, written into one
  preallocated buffer of all P·L rows and H/P heads (``UlyssesStore``; L: a rank's rows). The buffer has the bytes of
  this rank's own K and V: no whole-sequence K/V of all heads exists, and no local K/V beside the global one.
- phase Q: each Q chunk is exchanged the same way (every rank's chunk rows of this rank's heads), attended against
  the buffer by the inner consumer (PyTorch SDPA), and the output exchanged back ([B, H, c, D], this rank's rows),
  before the rest of the block (output projection, gate, residual, MLP) runs on it.

Key rows sit rank by rank (each rank's rows, static ones included, in its order): non-causal attention without a
mask does not depend on the order of its keys. Every rank must run the same chunks in the same order (each exchange
is a collective): plans are agreed across ranks (``agree_min``, ``agree``) and a chunk is never retried alone.

What a block runs under is found by probes (``register_parallel_probe``): a library file says how its modules carry
a parallel configuration (diffusers: ``processor._parallel_config``). This file knows no library."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import ConsumerCaps


@dataclass(frozen=True)
class SequenceParallel:
    """The sequence parallelism a block's attention runs under: ``mode`` "ulysses" (all-to-all over heads) or another
    (ring, unified: not served here, ``problem`` says why), ``degree`` ranks in ``group``, this one ``rank``."""

    mode: str
    degree: int
    rank: int
    group: Any
    label: str = ""             # how the library names it, for reports
    problem: str | None = None  # why attention cannot stream under it (the block then runs stock)
    # a context in which the block's forward runs its attention on this rank's rows alone, without the library's
    # collectives (what a capture must trace); None: the library has no such switch, the block stays stock
    detach: Callable[[], Any] | None = None


_PROBES: list[Callable[[torch.nn.Module], "SequenceParallel | None"]] = []


def register_parallel_probe(probe: Callable[[torch.nn.Module], "SequenceParallel | None"]) -> None:
    if probe not in _PROBES:
        _PROBES.append(probe)


def parallel_of(module: torch.nn.Module) -> SequenceParallel | None:
    """The sequence parallelism ``module``'s attention runs under (None: one process)."""
    for probe in _PROBES:
        found = probe(module)
        if found is not None:
            return found
    return None


def heads_problem(par: SequenceParallel, heads: int, kv_heads: int) -> str | None:
    if heads % par.degree or kv_heads % par.degree:
        return (f"{heads} query / {kv_heads} K/V heads do not divide by the Ulysses degree {par.degree}: attention "
                "runs stock")
    return None


def _exchange(send: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all over the leading dimension (one index per rank): ``send[j]`` goes to rank j, and the result's ``[i]``
    came from rank i."""
    import torch.distributed as dist
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _by_heads(t: torch.Tensor, p: int) -> torch.Tensor:
    """[B, H, n, D] -> [p, n, B, H/p, D], contiguous: heads group j first (what rank j gets), rows next."""
    return t.unflatten(1, (p, t.shape[1] // p)).permute(1, 3, 0, 2, 4).contiguous()


class UlyssesStore:
    """K and V of every rank's rows for this rank's H/P heads, written chunk by chunk as phase KV makes them (each
    ``write`` is one all-to-all: every rank writes the same rows in the same order). Kept rows first,
    ``[P·L, B, H/P, D]``, handed to attention as ``[B, H/P, P·L, D]`` views."""

    kind = "ulysses"
    exact = True

    def __init__(self, par: SequenceParallel, device: torch.device):
        self.par, self.device = par, torch.device(device)
        self.rows = 0
        self.k = self.v = None

    def allocate(self, k: torch.Tensor, total: int) -> None:
        B, H, _, D = k.shape
        p = self.par.degree
        self.rows, self.local = p * total, total
        self.k = torch.empty(p, total, B, H // p, D, dtype=k.dtype, device=k.device)
        self.v = torch.empty_like(self.k)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, p = k.shape[2], self.par.degree
        for buf, t in ((self.k, k), (self.v, v)):
            recv = _exchange(_by_heads(t, p), self.par.group)
            buf[:, start:start + n].copy_(recv)
            del recv

    def finish(self) -> None:
        pass

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.flatten(0, 1).permute(1, 2, 0, 3) for t in (self.k, self.v))

    def block(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.whole()
        return k[:, :, a:b], v[:, :, a:b]

    def blocks(self, stop: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        k, v = self.block(0, stop)
        yield 0, k, v

    def device_bytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def host_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self.k = self.v = None


class UlyssesAttention:
    """The attention consumer under Ulysses: Q chunks exchanged to this rank's heads over every rank's chunk rows,
    attended against a ``UlyssesStore`` by ``inner``, exchanged back. Non-causal, unmasked attention only (the key
    order across ranks is not the sequence order)."""

    def __init__(self, inner: Any, par: SequenceParallel):
        self.inner, self.par = inner, par
        self.name = f"ulysses[{par.degree}]({getattr(inner, 'name', type(inner).__name__)})"
        c = inner.caps
        self.caps = ConsumerCaps(bounded_q=c.bounded_q, q_offset=False, gqa=c.gqa, masks=frozenset(),
                                 kv_blocks_lse=False, dtypes=c.dtypes, max_head_dim=c.max_head_dim)

    def store(self, device: torch.device) -> UlyssesStore:
        return UlyssesStore(self.par, device)

    def attend(self, q, k, v, *, q_offset, causal, mask, scale):
        raise RuntimeError("under Ulysses attention reads its K/V from a UlyssesStore (attend_store)")

    def attend_store(self, q: torch.Tensor, store: UlyssesStore, *, q_offset: int, causal: bool,
                     scale: float | None) -> torch.Tensor:
        if causal:
            raise RuntimeError("Ulysses streaming takes non-causal attention only")
        p, group = self.par.degree, self.par.group
        B, H, c, D = q.shape
        recv = _exchange(_by_heads(q, p), group)                       # [p, c, B, H/p, D]: rank i's rows, my heads
        q_all = recv.permute(2, 3, 0, 1, 4).reshape(B, H // p, p * c, D)
        del recv
        k, v = store.whole()
        o = self.inner.attend(q_all, k, v, q_offset=0, causal=False, mask=None, scale=scale)
        del q_all
        send = o.unflatten(2, (p, c)).permute(2, 3, 0, 1, 4).contiguous()   # [p, c, B, H/p, D]: rank j's rows
        del o
        back = _exchange(send, group)                                  # [p, c, B, H/p, D]: my rows, heads group j
        del send
        return back.permute(2, 0, 3, 1, 4).reshape(B, H, c, D)

    def workspace_row_bytes(self, *, heads: int, head_dim: int, elem: int, causal: bool, masked: bool) -> int:
        """Per query row: the inner consumer's own, plus the exchanges' buffers (Q sent and received, the output
        sent and received, at most three alive at once)."""
        declare = getattr(self.inner, "workspace_row_bytes", None)
        inner = declare(heads=heads, head_dim=head_dim, elem=elem, causal=causal, masked=masked) if declare else 0
        return inner + 3 * heads * head_dim * elem


def _collective_device(par: SequenceParallel, device: torch.device) -> torch.device:
    import torch.distributed as dist
    backend = str(dist.get_backend(par.group))
    return device if "nccl" in backend and device.type == "cuda" else torch.device("cpu")


def agree_min(value: int | None, par: SequenceParallel, device: torch.device) -> int | None:
    """The smallest of every rank's ``value`` (a memory budget: the plan must fit the fullest card); None on every
    rank when any rank has None."""
    import torch.distributed as dist
    t = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64, device=_collective_device(par, device))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=par.group)
    lo = int(t.item())
    return None if lo < 0 else lo


def agree(fingerprint: str, par: SequenceParallel, device: torch.device) -> list[int]:
    """Every rank's hash of ``fingerprint`` (a plan, as text), in rank order: the caller compares them. Hashes travel
    as tensors, so NCCL carries them as it carries the exchanges."""
    import hashlib

    import torch.distributed as dist
    h = int.from_bytes(hashlib.sha1(fingerprint.encode()).digest()[:7], "big")
    where = _collective_device(par, device)
    mine = torch.tensor([h], dtype=torch.int64, device=where)
    found = [torch.empty_like(mine) for _ in range(par.degree)]
    dist.all_gather(found, mine, group=par.group)
    return [int(t.item()) for t in found]


__all__ = ["SequenceParallel", "register_parallel_probe", "parallel_of", "heads_problem", "UlyssesStore",
           "UlyssesAttention", "agree_min", "agree"]
