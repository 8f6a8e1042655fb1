"""Turning what users type as a memory budget into bytes."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
_PATTERN = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = "bytes (an int), a size string like '12GiB', '900MB' or '1e9'"

DEFAULT_RESERVE = 512 * 2**20


def parse_budget(budget: int | float | str | None, device: torch.device | None = None,
                 reserve: int = DEFAULT_RESERVE, *, arg: str = "budget", allow_zero: bool = False) -> int | None:
    """Bytes from an int, ``"12GiB"``/``"900MB"``/``"1e9"``, or ``"auto"`` (free device memory minus ``reserve``).

    ``arg`` names the argument in errors (``reserve`` is parsed here too, and may be 0 with ``allow_zero``)."""
    accepted = _ACCEPTED + ("" if arg != "budget" else ", or 'auto'")
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ValueError(f"{arg} must be {accepted}; got {budget!r} ({type(budget).__name__})")
    if isinstance(budget, str):
        if budget.strip().lower() == "auto" and arg == "budget":
            return auto_budget(device, reserve)
        match = _PATTERN.match(budget)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{arg} {budget!r} cannot be parsed: use {accepted}")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        value = budget
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{arg} must be a finite number of bytes; got {budget!r}. Use {accepted}")
    if value < 0 or (value < 1 and not (allow_zero and value == 0)):
        least = "0 or more" if allow_zero else "at least 1 byte"
        raise ValueError(f"{arg} must be {least}; got {budget!r}. Use {accepted}")
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


def stranded_blocks_note(device: torch.device, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a whole-forward budget the plan holds may still run out on a real card, or None: a budget counts allocated
    bytes, a card also what the caching allocator keeps reserved and unused; expandable segments reuse such blocks
    (docs/budgets-and-tiers.md has the run that showed it)."""
    if device.type != "cuda":
        return None
    conf = ",".join(environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return None
    return ("the budget counts allocated bytes; a card also holds what PyTorch's caching allocator reserves and leaves "
            "unused: under a budget near the card's size set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before "
            "torch starts, or leave room above the budget")
