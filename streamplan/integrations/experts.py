"""Mixture-of-experts feed-forwards as one row-local op. A router picks each token's experts from that token's own row
(top-k of its logits), and each expert's output for a token depends on that row alone, so the module run on a chunk's
rows gives those rows' stock values; only the gather of each expert's tokens is data-dependent, which a capture cannot
trace over a symbolic row count. A capture takes the module whole (``graph.opaque_layers``) and the graph runs it on
each chunk. Routers that drop tokens over an expert's capacity choose which tokens to keep from every row of the
call: their blocks stay stock, named. Recognised by structure (an ``experts`` part beside a ``gate`` or ``router``),
which transformers' sparse-MoE blocks and diffusers' MoE feed-forwards share; their settings by the names the two
libraries give them. One file for both: the convention is theirs in common."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from ..registries import OpaqueKind, register_opaque_layer

_CAPACITY = ("capacity_factor", "expert_capacity", "moe_capacity_factor", "eval_capacity_factor")


def _router(m: nn.Module) -> nn.Module | None:
    r = getattr(m, "gate", None)
    if not isinstance(r, nn.Module):
        r = getattr(m, "router", None)
    return r if isinstance(r, nn.Module) else None


def is_experts(m: nn.Module) -> bool:
    return isinstance(getattr(m, "experts", None), nn.Module) and _router(m) is not None \
        and not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def _attr(m: nn.Module, *names: str):
    """The first of ``names`` set on the module, its router, its experts or a config any of them holds."""
    holders = [m, _router(m), getattr(m, "experts", None)]
    holders += [getattr(h, "config", None) for h in list(holders)]
    for name in names:
        for h in holders:
            v = getattr(h, name, None) if h is not None else None
            if v is not None and not isinstance(v, (nn.Module, torch.Tensor)):
                return v
    return None


def _num_experts(m: nn.Module) -> int:
    n = _attr(m, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if isinstance(n, int) and n > 0:
        return n
    experts = m.experts
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return len(experts)
    w = getattr(_router(m), "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else 1


def refusal(m: nn.Module) -> str | None:
    for name in _CAPACITY:
        v = _attr(m, name)
        if v:
            return (f"a router that drops tokens over an expert's capacity ({name}={v}): which tokens an expert keeps "
                    "depends on every row of the call, not each row alone")
    if _attr(m, "drop_tokens") is True:
        return "a router that drops tokens (drop_tokens=True): not each row alone"
    if _returns_tuple(type(m)) and second(m) is None:
        return ("its forward returns more than its rows and one per-token tensor beside them (router scores), or "
                "could not be run on three tokens to see what it returns")
    return None


def second(m: nn.Module) -> tuple[int, torch.dtype, bool] | None:
    """For a forward that returns a per-token tensor beside its rows (GPT-OSS's router scores): its features, dtype,
    and whether its tokens are flattened; learnt by running the module once on three zero tokens on its own device
    (before the capture traces), since the two libraries return scores, logits or their top-k in varying layouts."""
    if not _returns_tuple(type(m)):
        return None
    p = next(m.parameters(), None)
    w = getattr(_router(m), "weight", None)
    if p is None or p.device.type == "meta" or not isinstance(w, torch.Tensor):
        return None
    try:
        with torch.no_grad():
            out = m(torch.zeros(1, 3, int(w.shape[-1]), dtype=p.dtype, device=p.device))
    except Exception:  # noqa: BLE001 -- a module that cannot run alone stays stock, named by ``refusal``
        return None
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    tokens = tuple(out[1].shape[:-1])
    if tokens not in ((3,), (1, 3)):
        return None
    return int(out[1].shape[-1]), out[1].dtype, tokens == (3,)


@functools.cache
def _returns_tuple(cls: type) -> bool:
    """Whether the class's forward returns a tuple anywhere (read from its source; unreadable source counts as yes:
    the op gives back one tensor, and a caller unpacking two would split a batch)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.Return) and isinstance(n.value, (ast.Tuple, ast.List)) for n in ast.walk(tree))


def workspace(m: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(0, bytes per token) the module may allocate inside its call besides its output, at most. Either way an
    experts module runs, each token costs at most its k routed copies with their transients at once: a grouped matmul
    over all routed rows (transformers' ``grouped_mm`` experts) or one expert at a time (the loop) with every token
    at worst sent to one. A copy's transients: the gathered row, the widest projection and its activation, the weighted
    output; beside them the zeroed accumulator and the input's flattened copy, then the router's logits, their fp32
    softmax, the top-k choice, its one-hot over the experts (int64) and the sort of the routed tokens."""
    hidden, elem = int(x.shape[-1]), x.element_size()
    experts = _num_experts(m)
    k = _attr(m, "top_k", "num_experts_per_tok", "moe_top_k", "num_selected_experts")
    k = int(k) if isinstance(k, int) and k > 0 else experts
    stacked = m.experts if not isinstance(m.experts, (nn.ModuleList, nn.ModuleDict)) else None
    width = 0
    for name, p in m.named_parameters():   # the widest projection a token goes through: [E, 2I, H] gives 2I
        if p.dim() >= 2 and hidden in p.shape[-2:]:
            w = p.shape[-2] * p.shape[-1] // hidden
            if p.dim() == 2 and stacked is not None and name.startswith("experts.") and w % experts == 0:
                w //= experts   # every expert's weight stacked in one matrix, [E*I, H] (DBRX)
            width = max(width, w)
    copies = 1 if _loop(m) else k   # the loop holds one expert's copies at a time: each token's once at worst
    per_token = elem * (2 * hidden + copies * (2 * hidden + 2 * width)) + 8 * k * (experts + 1) + 16 * experts + 24 * k
    return 0, per_token


def _loop(m: nn.Module) -> bool:
    """Whether the experts run one expert at a time: transformers' experts under their "eager" implementation (the
    default of a module built alone; ``from_pretrained`` picks "grouped_mm" where it can)."""
    config = getattr(m.experts, "config", None)
    return config is not None and getattr(config, "_experts_implementation", "eager") in (None, "eager")


LOOP_LAUNCHES = 10   # kernel launches per expert of the loop (its tokens found, gathered, two linears, the
#                      activation, the weights, the add), one a host sync (``torch.where``)
GROUPED_LAUNCHES = 24   # a grouped or batched experts call, the router's ops included


def work(m: nn.Module, x: torch.Tensor) -> tuple[float, int]:
    """(FLOPs per token, kernel launches per call): the router over every expert, then k experts' projections; a loop
    over the experts launches its kernels for each (the per-chunk cost that makes small chunks slow)."""
    experts = _num_experts(m)
    k = _attr(m, "top_k", "num_experts_per_tok", "moe_top_k", "num_selected_experts")
    k = int(k) if isinstance(k, int) and k > 0 else experts
    expert_params = sum(p.numel() for n, p in m.named_parameters() if n.startswith("experts.") and p.dim() >= 2)
    other = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("experts.") and p.dim() >= 2)
    flops = 2.0 * (other + k * expert_params / max(1, experts))
    loop = _loop(m) or isinstance(m.experts, (nn.ModuleList, nn.ModuleDict))
    return flops, (experts * LOOP_LAUNCHES + GROUPED_LAUNCHES) if loop else GROUPED_LAUNCHES


register_opaque_layer(OpaqueKind("mixture of experts", is_experts, lambda m, x: int(x.shape[-1]), workspace,
                                 refusal, second, work))
