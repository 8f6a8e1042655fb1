"""Streamed MLP execution: row chunks into one preallocated output, optionally feature-sliced."""
from __future__ import annotations

from typing import Callable

import torch

from ..specs import MLPSpec
from ..plan.planner import Plan, Tier
from .chunk_loop import for_chunks


def run_row_chunked(stock: Callable[[torch.Tensor], torch.Tensor], x2: torch.Tensor, chunk: int) -> torch.Tensor:
    """The module's own forward on row chunks, each result copied into its rows of the output."""
    rows = x2.shape[0]
    out: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        y = stock(x2[a:b])
        if not out:
            out.append(y.new_empty((rows, y.shape[-1])))
        out[0][a:b].copy_(y)

    for_chunks(rows, chunk, work)
    return out[0]


def run_feature_sliced(spec: MLPSpec, x2: torch.Tensor, chunk: int, ffn_slice: int) -> torch.Tensor:
    """out[rows] = sum over hidden slices of hidden_slice @ W_out[:, slice]^T (+ bias once)."""
    rows = x2.shape[0]
    w_out, b_out = spec.out_proj.weight, spec.out_proj.bias
    out: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        xc = x2[a:b]
        for s in range(0, spec.ffn, ffn_slice):
            e = min(s + ffn_slice, spec.ffn)
            h = spec.hidden(xc, s, e)
            if not out:
                out.append(h.new_empty((rows, spec.dim_out)))
            oc = out[0][a:b]
            w = w_out[:, s:e].t()
            if s == 0:   # the first slice overwrites: a retried chunk never accumulates twice
                if b_out is not None:
                    torch.addmm(b_out, h, w, out=oc)
                else:
                    torch.mm(h, w, out=oc)
            else:
                oc.addmm_(h, w)
            del h

    for_chunks(rows, chunk, work)
    return out[0]


def run_mlp(spec: MLPSpec, plan: Plan, stock: Callable[[torch.Tensor], torch.Tensor],
            x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if plan.tier == Tier.L2 and not torch.is_autocast_enabled():
        out = run_feature_sliced(spec, x2, plan.chunk, plan.ffn_slice)
    else:
        out = run_row_chunked(stock, x2, plan.chunk)
    return out.view(*x.shape[:-1], out.shape[-1])


def run_seq_chunked(stock: Callable[..., torch.Tensor], x: torch.Tensor, chunk: int, rest: tuple,
                    kwargs: dict) -> torch.Tensor:
    """A row-local module's own forward on chunks of dim 1 (the sequence), each written into one output."""
    rows = x.shape[1]
    out: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        y = stock(x[:, a:b], *rest, **kwargs)
        if not out:
            out.append(y.new_empty((*y.shape[:1], rows, *y.shape[2:])))
        out[0][:, a:b] = y

    for_chunks(rows, chunk, work)
    return out[0]
