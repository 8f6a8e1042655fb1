"""The fewest rows a capture is retried from where export's guard names them: a block that cuts its rows at a fixed
count (``fixed_row_slices``) holds only where the rows past the cut exist, and export says so as
``... got <= for 417/32 <= rows`` (torch's solver failing to print the bound as an equality)."""
from __future__ import annotations

import re

import sympy

_GUARD = re.compile(r"got <= for (\d+)(?:/(\d+))? <= rows")


def least_rows(reason: str) -> int | None:
    """One more than the count the guard names, so the side past the cut never holds a single row the trace would
    specialise on (its guard ``rows - n != 1``); None where the reason names no such count."""
    m = _GUARD.search(reason)
    if m is None:
        return None
    return int(sympy.ceiling(sympy.Rational(int(m.group(1)), int(m.group(2) or 1)))) + 1
