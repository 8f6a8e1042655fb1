"""What a call handler is given: the installed record, the user's options, a sink for notes and the planner's entry
point. Handlers read and report through it and never reach back into the handle that installed them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(eq=False)
class CallContext:
    """One installed module's view of its handle, for a call.

    ``entry``: what was installed (``name``, ``module``, ``spec``, ``stock``, and per input signature ``plans`` and
    ``kv_errors``; ``runtime_notes`` so far). ``note(text)``: report something about this module once.
    ``plan(sig, make, args, kwargs, device)``: the plan for this signature, made once by ``make(available bytes)``
    under the budget (the budget's refusal raised as ``BudgetError``). ``installed()``: every module the handle
    streams (a model forward reads the plans its blocks made)."""

    entry: Any
    options: Any
    note: Callable[[str], None]
    plan: Callable[..., Any]
    installed: Callable[[], list]
