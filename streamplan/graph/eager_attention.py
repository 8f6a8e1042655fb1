"""Attention written by hand, found in a captured graph and made one attention op the analysis knows.

``softmax(f(q @ k^T)) @ v`` over the rows is what "eager" attention is (transformers' ``eager_attention_forward``,
hand-written attention in custom blocks): as ops over rows x rows the analysis cannot chunk it (the first matmul
contracts over the rows). Where the graph has exactly that shape:

    matmul(q, transpose(k))  ->  scalar mul/div ...  ->  [div c -> tanh -> mul c]  ->  [+ mask]  ->  softmax(-1)
    ->  [cast]  ->  [dropout, off]  ->  matmul(., v)

(K and V possibly through transformers' ``repeat_kv``: unsqueeze -> expand -> reshape, taken back to their own heads),
the chain becomes one ``streamplan::eager_attention(query, key, value, attn_mask, scale, softcap)``: the scores
scaled, soft-capped as ``c * tanh(s / c)`` where the graph does that (Gemma 2's attention logit soft-capping), the mask
added, softmax in fp32. Anything else in the chain, or a chain value used elsewhere, leaves the graph as it was (and
the block stock, named by the analysis).
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass

import torch
from torch import fx

from .analyze import IGNORED_OPS, op_name
from .graph_edits import erase_unused


@torch.library.custom_op("streamplan::eager_attention", mutates_args=())
def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    scale: float, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Whole attention as the matched chain computes it (reference and fallback; streamed chunks go through the
    attention consumer): scores in fp32, soft-capped where ``softcap`` > 0, the mask added, softmax in fp32 (with a
    column per head's sink, dropped after, where ``sinks`` is given)."""
    B, H, n, D = query.shape
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    if sinks is not None:
        p = torch.softmax(torch.cat([s, sinks.float().view(1, H, 1, 1).expand(B, H, n, 1)], -1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(query.dtype)


@eager_attention.register_fake
def _(query, key, value, attn_mask, scale, softcap, sinks=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


_SCALARS = {"mul", "div"}


@dataclass
class _Match:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float
    softcap: float
    chain: list[fx.Node]     # the nodes replaced (erased once the new op has their uses)
    out: fx.Node             # the second matmul
    sinks: fx.Node | None = None   # a [heads] value joined to the scores as one more column (attention sinks)
    batched: bool = False    # [batch * heads, rows, D] (baddbmm and bmm): taken as one batch of that many heads


def _only_user(n: fx.Node) -> fx.Node | None:
    users = [u for u in n.users if u.target not in IGNORED_OPS]
    return users[0] if len(users) == 1 else None


def _scalar(n: fx.Node) -> float | None:
    """The scalar factor of ``mul``/``div`` by a number (None otherwise)."""
    if len(n.args) != 2 or not isinstance(n.args[1], numbers.Number) or isinstance(n.args[1], bool):
        return None
    return float(n.args[1])


def _unrepeat(n: fx.Node) -> fx.Node:
    """transformers' ``repeat_kv`` (unsqueeze(2) -> expand -> reshape to more heads) taken back to its input."""
    if op_name(n.target) not in ("reshape", "view", "_unsafe_view"):
        return n
    e = n.args[0]
    if not isinstance(e, fx.Node) or op_name(e.target) != "expand":
        return n
    u = e.args[0]
    if not isinstance(u, fx.Node) or op_name(u.target) != "unsqueeze" or u.args[1] != 2:
        return n
    src = u.args[0]
    sv, nv = src.meta.get("val"), n.meta.get("val")
    if sv is None or nv is None or sv.dim() != 4 or nv.dim() != 4 or nv.shape[1] % sv.shape[1]:
        return n
    return src


def _match(sm: fx.Node) -> _Match | None:
    val = sm.meta.get("val")
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if val is None or val.dim() not in (3, 4) or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return None
    chain = [sm]
    x = sm.args[0]
    mask = None
    sinks = _sinks(x, chain)
    if sinks is not None:
        x = chain[-1].args[0][0]   # the scores beside the sinks' column
    if op_name(x.target) == "add" and len(x.args) == 2 and all(isinstance(a, fx.Node) for a in x.args) \
            and _only_user(x) is chain[-1]:
        chain.append(x)
        left, right = x.args
        x, mask = (left, right) if op_name(right.target) not in _SCALARS | {"tanh", "matmul"} else (right, left)
    ops = []
    while isinstance(x, fx.Node) and op_name(x.target) in _SCALARS | {"tanh"}:
        if _only_user(x) is not chain[-1] or (op_name(x.target) != "tanh" and _scalar(x) is None):
            return None
        chain.append(x)
        ops.append(x)
        x = x.args[0]
    while isinstance(x, fx.Node) and op_name(x.target) in ("to", "_to_copy") and _only_user(x) is chain[-1] \
            and not ops:   # diffusers' upcast of the scores before the softmax
        chain.append(x)
        x = x.args[0]
    if not isinstance(x, fx.Node) or op_name(x.target) not in ("matmul", "baddbmm") or _only_user(x) is not chain[-1]:
        return None
    chain.append(x)
    batched = op_name(x.target) == "baddbmm"   # diffusers' classic processor: [B * H, rows, D], scaled by alpha
    if batched != (val.dim() == 3):   # a 3-D chain is the classic processor's alone
        return None
    scale, softcap = 1.0, 0.0
    if batched:
        if mask is not None:
            return None
        mask, scale = _baddbmm_base(x, chain)
        if scale is None:
            return None
        q, kt = x.args[1], x.args[2]
    else:
        q, kt = x.args
    nd = 3 if batched else 4
    if op_name(kt.target) != "transpose" or sorted(d % nd for d in kt.args[1:3]) != [nd - 2, nd - 1] or \
            _only_user(kt) is not x:
        return None
    chain.append(kt)
    # the scalar ops from the matmul outward: factors, then an optional c * tanh(s / c)
    ops.reverse()
    tanh = [i for i, o in enumerate(ops) if op_name(o.target) == "tanh"]
    if len(tanh) > 1:
        return None
    if tanh:
        i = tanh[0]
        if i == 0 or i + 2 != len(ops) or op_name(ops[i - 1].target) != "div" or op_name(ops[i + 1].target) != "mul" \
                or _scalar(ops[i - 1]) != _scalar(ops[i + 1]) or not _scalar(ops[i - 1]):
            return None
        softcap = _scalar(ops[i - 1])
        ops = ops[:i - 1]
    for o in ops:
        f = _scalar(o)
        if op_name(o.target) == "div" and not f:
            return None
        scale = scale * f if op_name(o.target) == "mul" else scale / f
    # after the softmax: the sinks' column cut off, an optional cast, an optional dropout that is off, then the matmul
    y = _only_user(sm)
    if sinks is not None:
        if y is None or op_name(y.target) != "slice" or y.args[1] % 4 != 3 or (y.args[2] or 0) != 0 or \
                y.args[3] != -1:
            return None
        chain.append(y)
        y = _only_user(y)
    while y is not None and op_name(y.target) in ("to", "_to_copy", "type_as", "dropout"):
        if op_name(y.target) == "dropout" and (float(y.args[1]) > 0 and bool(y.args[2] if len(y.args) > 2 else True)):
            return None
        chain.append(y)
        y = _only_user(y)
    if y is None or op_name(y.target) != ("bmm" if batched else "matmul") or y.args[0] is not chain[-1]:
        return None
    k = _unrepeat(kt.args[0]) if not batched else kt.args[0]
    v = _unrepeat(y.args[1]) if not batched else y.args[1]
    if k is not kt.args[0]:
        chain.append(kt.args[0])
    if v is not y.args[1]:
        chain.append(y.args[1])
    if mask is not None and (mask.meta.get("val") is None or mask.meta["val"].dim() != nd):
        return None
    if sinks is not None and softcap:
        return None
    return _Match(q, k, v, mask, scale, softcap, chain, y, sinks, batched)


def _baddbmm_base(x: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node | None, float | None]:
    """``baddbmm(base, q, k^T, beta, alpha)`` as diffusers' ``get_attention_scores`` calls it: beta 0 over an
    ``empty`` base (no mask; the base joins the chain), or beta 1 over the mask. (mask, alpha); alpha None: neither."""
    base = x.args[0]
    beta = x.kwargs.get("beta", x.args[3] if len(x.args) > 3 else 1)
    alpha = x.kwargs.get("alpha", x.args[4] if len(x.args) > 4 else 1)
    if not isinstance(alpha, numbers.Number) or isinstance(alpha, bool) or not isinstance(base, fx.Node):
        return None, None
    if beta == 0:
        if op_name(base.target) not in ("empty", "zeros", "new_empty", "new_zeros") or _only_user(base) is not x:
            return None, None
        chain.append(base)
        return None, float(alpha)
    return (base, float(alpha)) if beta == 1 else (None, None)


def _sinks(x: fx.Node, chain: list[fx.Node]) -> fx.Node | None:
    """Attention sinks before the softmax: ``cat([scores, sinks.reshape(1, H, 1, 1).expand(..)], -1)`` less its row
    maxima; the [heads] sinks value, the chain extended by those nodes (the ``cat`` last), or None."""
    if op_name(x.target) != "sub" or len(x.args) != 2 or not all(isinstance(a, fx.Node) for a in x.args):
        return None
    cat, top = x.args
    if op_name(cat.target) != "cat" or len(cat.args[0]) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) % 4 != 3:
        return None
    if top.target is not operator.getitem or top.args[1] != 0 or op_name(top.args[0].target) != "max" or \
            top.args[0].args[0] is not cat:
        return None
    mx = top.args[0]
    if set(cat.users) != {x, mx} or any(u.target is not operator.getitem or (u is not top and u.users)
                                        for u in mx.users):
        return None
    src, views = cat.args[0][1], []
    while isinstance(src, fx.Node) and op_name(src.target) in ("expand", "reshape", "view", "unsqueeze"):
        views.append(src)
        src = src.args[0]
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if val is None or val.dim() != 1:
        return None
    chain.extend([x, *mx.users, mx, *views, cat])
    return src


def fuse_eager_attention(graph: fx.Graph) -> int:
    """Replace every hand-written attention chain in ``graph`` by one ``streamplan::eager_attention``; returns how
    many. Nodes of the chain that something else still uses stay (the graph stays correct either way)."""
    found = 0
    for sm in [n for n in graph.nodes if n.op == "call_function" and op_name(n.target) in ("softmax", "_softmax")]:
        m = _match(sm)
        if m is None:
            continue
        with graph.inserting_before(m.out):
            q, k, v, mask = (_unsqueezed(graph, t) if m.batched and t is not None else t
                             for t in (m.q, m.k, m.v, m.mask))
            new = graph.call_function(torch.ops.streamplan.eager_attention.default,
                                      (q, k, v, mask, m.scale, m.softcap, m.sinks))
            new.meta = {**m.out.meta, "val": q.meta["val"].new_empty(q.meta["val"].shape[:-1] + (
                v.meta["val"].shape[-1],))} if m.batched else dict(m.out.meta)
            if m.batched:   # back to [batch * heads, rows, D]
                new = graph.call_function(torch.ops.aten.squeeze.dim, (new, 0))
                new.meta = dict(m.out.meta)
        m.out.replace_all_uses_with(new)
        for n in [m.out, *m.chain]:
            for u in list(n.users):
                if u.target in IGNORED_OPS and not u.users:
                    graph.erase_node(u)
        erase_unused(graph, [m.out, *m.chain])
        found += 1
    if found:
        graph.lint()
    return found


def _unsqueezed(graph: fx.Graph, t: fx.Node) -> fx.Node:
    """``t`` [batch * heads, rows, ...] as one batch of that many heads, [1, batch * heads, rows, ...]."""
    node = graph.call_function(torch.ops.aten.unsqueeze.default, (t, 0))
    node.meta = {"val": t.meta["val"].unsqueeze(0)}
    return node
