"""L6: rows kept in host memory between blocks. A model forward that streamplan runs allocates its hidden state (and
its per-row tables) here and hands them to its blocks as ``specs.HostRows``; a block streamed from its graph reads
each chunk's rows back to the device and writes its output rows into the same host buffer, so the device holds
chunk-sized work whatever the sequence length.

Host memory is pinned on CUDA (copies run asynchronously on the compute stream, in its order: a chunk's rows are read
before its output overwrites them, and the next block reads them after). In a CPU run the "device" is the host too:
the rows come from numpy's allocator, an arena apart from torch's (which the meter watches, as it watches the CUDA
allocator on a GPU), so tests see what stays on the device side. In a rehearsal they are fake host tensors, counted
as host bytes, not device bytes."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .call_state import REHEARSAL, rehearsing
from .rehearsal import ledger_paused
from ..plan.budget import fmt_bytes
from ..plan.planner import HostMemoryError
from ..specs import HostRows, RowsFrom, to_compute


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for rows a block on ``device`` reads: pinned on CUDA, numpy's arena on CPU, a fake host tensor in
    a rehearsal (its bytes counted as host memory)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if rehearsing():
        with ledger_paused():   # not a device allocation
            t = torch.empty(shape, dtype=dtype, device="cpu")
        REHEARSAL.ledger.count_host(t)
        return t
    if device.type == "meta":   # a plan on shapes only (`streamplan plan`): nothing to hold
        return torch.empty(shape, dtype=dtype, device="meta")
    if not nbytes:   # no rows (a store that keeps them all on the device)
        return torch.empty(shape, dtype=dtype)
    if device.type == "cuda":
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            raise HostMemoryError(f"streamplan: {fmt_bytes(nbytes)} of pinned host memory could not be had for rows "
                                  f"kept off the device ({exc}); free host memory or raise the budget so the hidden "
                                  "state stays on the device", needed=nbytes, available=None) from None
    import numpy as np
    raw = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


def to_host(t: torch.Tensor, device: torch.device) -> HostRows:
    """A device tensor's copy in host memory (a per-row table the model built whole), for blocks on ``device``."""
    host = host_empty(tuple(t.shape), t.dtype, device)
    host.copy_(t, non_blocking=True)
    return HostRows(host, device)


on_device = to_compute   # rows of a host tensor on the compute device


def rows(x: torch.Tensor | HostRows, a: int, b: int, dim: int = 1) -> torch.Tensor:
    """Rows [a, b) of ``x`` along ``dim`` on the compute device (a view where ``x`` is already there)."""
    if isinstance(x, HostRows):
        return on_device(x.tensor.narrow(dim, a, b - a), x.device)
    return x.narrow(dim, a, b - a)


def picked(x: torch.Tensor | HostRows, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x.index_select(dim, index)`` on the compute device (host rows picked on the host, then copied)."""
    if isinstance(x, HostRows):
        return on_device(x.tensor.index_select(dim, index.to(x.tensor.device)), x.device)
    return x.index_select(dim, index)


def placed(dst: torch.Tensor | HostRows, index: torch.Tensor, src: torch.Tensor, dim: int = 1) -> None:
    """``dst.index_copy_(dim, index, src)``, into host rows as well (``src`` copied to the host first)."""
    if isinstance(dst, HostRows):
        host = dst.tensor.device
        dst.tensor.index_copy_(dim, index.to(host), src.to(host))
        return
    dst.index_copy_(dim, index, src)


def kept(out: Any, into: HostRows) -> Any:
    """A block's output back in the host buffer ``into`` (its donated input) when the block handed back device rows
    (it ran stock, or brought its rows to the device whole); as it is otherwise."""
    if isinstance(out, HostRows) or not isinstance(out, torch.Tensor):
        return out
    if out.shape == into.tensor.shape and out.dtype == into.tensor.dtype:
        into.tensor.copy_(out, non_blocking=True)
        return into
    return to_host(out, into.device)


def taken(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[int, HostRows | RowsFrom]]:
    """The call with each described row input (at the top level or in a tuple or list) replaced by a tensor of its
    shape: a ``HostRows`` by its host tensor, a ``RowsFrom`` by a meta placeholder (its rows are built, never read
    from it); and each of those tensors' description by ``id``."""
    found: dict[int, HostRows | RowsFrom] = {}

    def take(v):
        if isinstance(v, HostRows):
            found[id(v.tensor)] = v
            return v.tensor
        if isinstance(v, RowsFrom):
            with ledger_paused():   # no memory (a plan on meta tensors would count it as the device's)
                t = torch.empty(v.shape, dtype=v.dtype, device="meta")
            found[id(t)] = v
            return t
        return v

    def top(v):
        if isinstance(v, (tuple, list)):
            return type(v)(take(x) for x in v)
        return take(v)

    return tuple(top(v) for v in args), {k: top(v) for k, v in kwargs.items()}, found


def stand_ins(tree: Any, host: dict[int, HostRows]) -> Any:
    """``tree`` with each host tensor replaced by a fake one of its shape, strides and dtype on its compute device
    (nothing allocated): what a capture traces, so the graph's own tensors are made where the block computes."""
    if not host:
        return tree
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    # a rehearsal's own fake mode (its other inputs are its fakes), else one of its own
    mode = detect_fake_mode(pytree.tree_leaves(tree)) or FakeTensorMode(allow_non_fake_inputs=True)

    def stand_in(v):
        h = host.get(id(v)) if isinstance(v, torch.Tensor) else None
        if h is None:
            return v
        with mode:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=h.device)
    return pytree.tree_map(stand_in, tree)


def brought_whole(tree: Any, host: dict[int, HostRows]) -> Any:
    """``tree`` with each host tensor's rows on its compute device, whole (a block that cannot read them in chunks)."""
    if not host:
        return tree
    return pytree.tree_map(lambda v: host[id(v)].whole() if isinstance(v, torch.Tensor) and id(v) in host else v,
                           tree)


def device_only(tree: Any, host: dict[int, HostRows]) -> Any:
    """``tree`` without its host tensors (None in their place): what is live on the device around a call."""
    if not host:
        return tree
    return pytree.tree_map(lambda v: None if isinstance(v, torch.Tensor) and id(v) in host else v, tree)


def rewrapped(out: Any, host: dict[int, HostRows]) -> Any:
    """A block's outputs with each host tensor it wrote into handed back as its ``HostRows``."""
    if not host:
        return out
    return pytree.tree_map(lambda v: host[id(v)] if isinstance(v, torch.Tensor) and id(v) in host else v, out)


def host_available() -> int:
    """Host memory the system has available now (what pinned buffers can be had from)."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host(needed: int) -> None:
    """Before a forward that keeps rows in host memory runs: the memory it needs can be had, else a clear error."""
    available = host_available()
    if needed > available:
        raise HostMemoryError(
            f"streamplan: the plan keeps rows in host memory and needs {fmt_bytes(needed)} of it; the system has "
            f"{fmt_bytes(available)} available. Free host memory, raise the device budget (fewer rows kept off the "
            "device), or shorten the sequence", needed=needed, available=available)
