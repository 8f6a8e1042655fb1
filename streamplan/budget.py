"""Turning what users type as a memory budget into bytes."""
from __future__ import annotations

import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

DEFAULT_RESERVE = 512 * 2**20


def parse_budget(budget: int | float | str | None, device: torch.device | None = None,
                 reserve: int = DEFAULT_RESERVE) -> int | None:
    """Bytes from an int, ``"12GiB"``/``"900MB"``, or ``"auto"`` (free device memory minus ``reserve``)."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise ValueError(f"budget must be bytes, a size string like '12GiB', or 'auto'; got {budget!r}")
    if isinstance(budget, (int, float)):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget!r}")
        return int(budget)
    if not isinstance(budget, str):
        raise ValueError(f"budget must be bytes, a size string like '12GiB', or 'auto'; got {type(budget).__name__}")
    if budget.strip().lower() == "auto":
        return auto_budget(device, reserve)
    match = _PATTERN.match(budget)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"budget {budget!r} cannot be parsed: use bytes or a size like '12GiB', '900MB', or 'auto'")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return int(value)


def auto_budget(device: torch.device | None, reserve: int = DEFAULT_RESERVE) -> int:
    """Free memory on the device as the allocator sees it, less a safety reserve."""
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return max(0, free + cached_free - reserve)
    try:
        import psutil  # optional
        return max(0, psutil.virtual_memory().available - reserve)
    except ImportError:
        import os
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(0, pages - reserve)


def fmt_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
