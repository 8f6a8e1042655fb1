"""What every hand-written diffusers model forward shares: the fingerprints of the library forwards streamplan follows,
and the check that a model's own forward is exactly one of them (the forwards themselves live in their family's file:
``wan.py``, ``h3.py``)."""
from __future__ import annotations

import torch
from torch import nn

from ...recognize.checks import call_args, source_fingerprint, stock_problem
from ...specs import Skip


# The source of each model forward streamplan reimplements, by the library version it was written against. A model
# whose forward differs (a newer diffusers) keeps its stock forward; its blocks still stream.
KNOWN_FORWARDS: dict[str, dict[str, str]] = {}   # class name -> {source fingerprint: version}, filled by family files


def own_forward_problem(module: nn.Module, cls: type) -> str | None:
    """Only the model's own forward may be replaced: its exact class forward, untouched (no patch or hook on the model
    itself), and its source exactly the one streamplan's copy follows."""
    if type(module).forward is not cls.forward:
        return f"{type(module).__name__}.forward is not the forward streamplan knows"
    known = KNOWN_FORWARDS.get(cls.__name__, {})
    if source_fingerprint(cls.forward) not in known:
        return (f"{cls.__name__}.forward differs from the versions streamplan follows "
                f"({', '.join(known.values()) or 'none'})")
    return stock_problem(module, subtree=False)




def left_stock(name: str, module: nn.Module, why: str) -> Skip:
    """A model whose forward keeps stock (its blocks still stream), and why."""
    return Skip(name, type(module).__name__, f"model forward left stock: {why}")


def unknown_forward(name: str, module: nn.Module, cls: type) -> Skip | None:
    """``left_stock`` where the model's forward is not the one streamplan follows (``own_forward_problem``)."""
    problem = own_forward_problem(module, cls)
    return left_stock(name, module, problem) if problem else None


def model_call(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict | str:
    """A model forward's arguments by name, or why the call keeps the stock forward (``attention_kwargs`` carry a LoRA
    scale the stock forward applies)."""
    call = call_args(names, args, kwargs)
    if isinstance(call, str):
        return call
    if call.get("attention_kwargs"):
        return "attention_kwargs are given (a LoRA scale)"
    return call


def call_problem(model: nn.Module, call: dict | str) -> str | None:
    """Why this call of a model keeps its stock forward: its arguments (``model_call``), or gradient checkpointing
    (the stock forward's own recompute under autograd)."""
    if isinstance(call, str):
        return call
    if torch.is_grad_enabled() and model.gradient_checkpointing:
        return "gradient checkpointing is active"
    return None
