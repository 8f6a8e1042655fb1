"""PyTorch ``scaled_dot_product_attention`` as the baseline consumer: bounded Q, offset causal, GQA, masks.

A causal chunk of query rows [a, a+c) sees keys [0, a) whole and keys [a, a+c) causally. Where PyTorch's fused kernels
return their log-sum-exp (flash, efficient and cuDNN on CUDA, flash on CPU), the two key ranges run as two fused calls,
each on the kernel PyTorch's own call would pick for it (``torch._fused_sdp_choice``), and are merged exactly by their
log-sum-exps; no [c, keys] mask is built. Elsewhere a lower-right causal mask is used.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .lse_merge import LseAccumulator, merge_bytes_per_row, merge_into

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _causal_rows(rows: int, keys: int, offset: int, device: torch.device) -> torch.Tensor:
    """Boolean mask: query row offset+i sees keys 0..offset+i."""
    q = torch.arange(offset, offset + rows, device=device).unsqueeze(-1)
    return torch.arange(keys, device=device) <= q


def _with_causal_rows(mask, rows: int, keys: int, offset: int, device: torch.device) -> torch.Tensor:
    """A chunk's mask (None, boolean or additive, cut to its ``keys``) with causality from row ``offset`` added."""
    allowed = _causal_rows(rows, keys, offset, device)
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask[..., :keys] & allowed
    return mask[..., :keys].masked_fill(~allowed, float("-inf"))


# PyTorch's SDPA backends by their ``SDPBackend`` values (``torch._C._get_sdp_priority_order``)
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3
_DEFAULT_ORDER = (_FLASH, _EFFICIENT, _MATH, _CUDNN)


def _priority() -> tuple[int, ...]:
    """The backends in the order set for SDPA calls now (PyTorch's default: flash, efficient, math, cuDNN;
    ``sdpa_kernel(..., set_priority=True)`` changes it)."""
    try:
        return tuple(int(b) for b in torch._C._get_sdp_priority_order())
    except (AttributeError, RuntimeError, TypeError):
        return _DEFAULT_ORDER


_ENABLED = {_FLASH: "flash_sdp_enabled", _EFFICIENT: "mem_efficient_sdp_enabled", _CUDNN: "cudnn_sdp_enabled",
            _MATH: "math_sdp_enabled"}


def _choice(q, k, v, causal: bool, scale) -> int | None:
    """The backend PyTorch's own SDPA call would pick for these inputs (its priority order, the caller's switches
    and, on Hopper and Blackwell, its preference for cuDNN), or None where it cannot say."""
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    try:
        return int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=scale, **gqa))
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        return None


def _fused_with_lse(q, k, v, causal: bool, scale):
    """(output, log-sum-exp [B, H, rows]) from a fused kernel, or None where none is available for these inputs.
    The kernel stock's own call picks for these inputs (``torch._fused_sdp_choice``: PyTorch's order, the caller's
    ``sdpa_kernel`` / ``enable_*_sdp`` switches, cuDNN first where PyTorch prefers it), then the other enabled ones
    in PyTorch's order should it refuse; None where math is the choice: the caller's own fp32 math then serves."""
    first = _choice(q, k, v, causal, scale)
    if first == _MATH:
        return None
    order = _priority() if first not in _KERNELS else (first, *(b for b in _priority() if b != first))
    gqa = q.shape[1] != k.shape[1]
    for backend in order:
        if not getattr(torch.backends.cuda, _ENABLED.get(backend, ""), lambda: False)():
            continue
        if gqa and backend not in _GQA_KERNELS:   # fewer K/V heads: only kernels known to take them as they are
            continue
        if backend == _MATH:
            return None
        kernel = _KERNELS.get(backend)
        got = kernel(q, k, v, causal, scale) if kernel is not None else None
        if got is not None:
            return got
    return None


def _flash_with_lse(q, k, v, causal: bool, scale):
    try:
        if q.device.type == "cuda":
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return out[0], out[1].reshape(q.shape[:3])
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse.reshape(q.shape[:3])
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return None


# looked up once (an op namespace's attribute lookup costs host time on every block of a store's pass)
_CUDNN_OP = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)


def _cudnn_with_lse(q, k, v, causal: bool, scale):
    cudnn = _CUDNN_OP
    if cudnn is None or q.device.type != "cuda":
        return None
    try:
        out = cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)
    except (RuntimeError, NotImplementedError):
        return None
    return out[0], out[1].reshape(q.shape[:3])


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, c, D] -> [B, Hkv, rep*c, D]: the query heads sharing a K/V head become rows of one call (exact when
    no mask depends on the row)."""
    B, H, c, D = q.shape
    return q.reshape(B, kv_heads, (H // kv_heads) * c, D)


def _gqa_fused(q, k, v, causal: bool, scale, fallback):
    """``_fused_with_lse`` with fewer K/V heads than Q heads given as they are where PyTorch has ``enable_gqa`` (cuDNN
    and flash on CUDA, flash on CPU: bit-identical to repeating them), else on ``fallback(q, k, v)``'s layout of the
    same call."""
    if q.shape[1] == k.shape[1]:
        return _fused_with_lse(q, k, v, causal, scale)
    got = _fused_with_lse(q, k, v, causal, scale) if _HAS_GQA else None
    return got if got is not None else _fused_with_lse(*fallback(q, k, v), causal, scale)


def _causal_by_parts(q, k, v, q_offset: int, scale):
    """Exact causal attention of a chunk, as keys [0, offset) whole plus the causal diagonal block, merged by LSE."""
    B, H, c, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    # the diagonal block (its K/V heads repeated where the kernels cannot take GQA: they go before the past), then
    # the past keys (the query heads sharing a K/V head as rows of one call there: a copy of Q)
    diag = _gqa_fused(q, k[..., q_offset:q_offset + c, :], v[..., q_offset:q_offset + c, :], True, scale,
                      lambda q, k, v: (q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)))
    past = _gqa_fused(q, k[..., :q_offset, :], v[..., :q_offset, :], False, scale,
                      lambda q, k, v: (_grouped(q, Hkv), k, v))
    if diag is None or past is None:
        return None
    (o2, lse2), (o1, lse1) = diag, past
    # into the diagonal block's output: one fused kernel on CUDA, PyTorch ops in head groups elsewhere (lse_merge)
    return merge_into(o1.reshape(B, H, c, D), lse1.reshape(B, H, c), o2, lse2)


def _cpu_flash_tiles(q_rows: int, k_rows: int, head_dim: int, elem: int) -> int:
    """PyTorch's CPU flash kernel allocates per thread, for the call: fp32 scores of one (query split x key split)
    tile, their row maxima and sums, an fp32 output tile, and the scores again in the input dtype for 16-bit inputs;
    the splits are fixed sizes cut to the call's rows (``FlashAttentionKernel.cpp``)."""
    qs = min(q_rows, 256 if q_rows >= 768 else 64 if q_rows >= 192 else 32)
    ks = min(k_rows, 512)
    tiles = (qs * ks + 2 * qs + qs * head_dim) * 4 + (qs * ks * elem if elem < 4 else 0)
    if elem < 4 and not onednn_16bit_gemm():   # PyTorch's own 16-bit gemm: fp32 copies of a head's keys and values
        tiles += (2 * k_rows + ks) * head_dim * 4   # (measured on a CPU without AVX-512: a bound, not a fit)
    return torch.get_num_threads() * tiles


@functools.cache
def onednn_16bit_gemm() -> bool:
    """Whether the CPU kernels' 16-bit matmuls go to oneDNN (AVX-512 CPUs), which allocates nothing the allocator
    sees; elsewhere PyTorch's fallback gemm widens its operands to fp32 first (bf16's probe stands for fp16 too)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def _efficient_with_lse(q, k, v, causal: bool, scale):
    """CUDA's memory-efficient kernel (takes fp32 too), its log-sum-exp cut to the query rows; None if it refuses."""
    fn = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
    if fn is None or q.device.type != "cuda":
        return None
    try:
        out = fn(q, k, v, None, True, 0.0, causal, scale=scale)
    except (RuntimeError, NotImplementedError):
        return None
    return out[0], out[1][..., :q.shape[-2]].reshape(q.shape[:3])


_KERNELS = {_FLASH: _flash_with_lse, _EFFICIENT: _efficient_with_lse, _CUDNN: _cudnn_with_lse}
_GQA_KERNELS = {_FLASH, _CUDNN}   # take fewer K/V heads than Q heads (bit-identical to repeating the heads)


MATH_SCORES = 1 << 26   # fp32 scores the math path holds at once (256 MiB): query rows are taken in pieces under it
MATH_SCORES_HELD = 3    # score-sized fp32 tensors it holds at its worst (scores, masked, exponentiated: the meter on a
#                         sinks layer's chunks, tests/test_attention_sinks.py)


def _math_with_lse(q, k, v, causal: bool, mask, scale):
    """fp32 attention of q [B, H, c, D] against one K/V block [B, Hkv, n, D] and its log-sum-exp, for what no fused
    kernel takes (masks): scores of this block only, query rows in pieces, so memory is bounded. Causal is top-left
    aligned."""
    B, H, c, D = q.shape
    piece = max(1, MATH_SCORES // max(1, B * H * k.shape[-2]))
    if c > piece:
        outs, lses = [], []
        for r in range(0, c, piece):
            m = None if mask is None else mask.expand(B, H, c, k.shape[-2])[:, :, r:r + piece]
            o, lse = _math_rows(q[:, :, r:r + piece], k, v, r if causal else None, m, scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 2), torch.cat(lses, 2)
    return _math_rows(q, k, v, 0 if causal else None, mask, scale)


def _math_rows(q, k, v, offset: int | None, mask, scale):
    """The math path on query rows ``offset``.. of a top-left causal block (None: not causal)."""
    B, H, c, D = q.shape
    causal = offset is not None
    Hkv, n = k.shape[1], k.shape[-2]
    qf = q.float().reshape(B, Hkv, H // Hkv, c, D)
    s = torch.matmul(qf, k.float().unsqueeze(2).transpose(-1, -2)) * (scale if scale is not None else D ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(c, n, dtype=torch.bool, device=q.device).triu(1 + offset), float("-inf"))
    if mask is not None:   # broadcastable to [B, H, c, n]
        m = mask.expand(B, H, c, n).reshape(B, Hkv, H // Hkv, c, n)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(p, v.float().unsqueeze(2))
    return out.reshape(B, H, c, D).to(q.dtype), lse.reshape(B, H, c)


SOFTCAP_SCORES = 1 << 24   # scores the soft-capped path holds at once at most (query rows, keys in pieces under it)
SOFTCAP_MIN_SCORES = 1 << 20   # ... and at least, where a chunk's own share (below) is smaller
SOFTCAP_ROW_SCORES = 256   # a chunk's share: this many scores per query row and head (a small chunk, small pieces)
SOFTCAP_KEYS = 8192        # keys per block of the soft-capped path past which blocks merge by their log-sum-exps


def softcap_scores(rows: int, heads: int) -> int:
    """Scores one piece of a soft-capped chunk of ``rows`` query rows holds: in proportion to the chunk, so that a
    planner short of memory shrinks them with the chunk, between SOFTCAP_MIN_SCORES and SOFTCAP_SCORES."""
    return min(SOFTCAP_SCORES, max(SOFTCAP_MIN_SCORES, rows * heads * SOFTCAP_ROW_SCORES))


def _softcapped(q, k, v, q_offset: int, causal: bool, mask, scale, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager attention computes it (no fused kernel soft-caps):
    scores in the inputs' dtype, ``c * tanh(s / c)``, the mask added, softmax in fp32, probabilities back in the
    inputs' dtype. Query rows in pieces and, past ``SOFTCAP_KEYS`` keys, keys in blocks merged by their log-sum-exps
    (``LseAccumulator``), so that at most ``softcap_scores(c, H)`` scores exist; the query heads that share a K/V head
    as rows of one matmul (K/V heads never repeated). Up to ``SOFTCAP_KEYS`` keys the ops are eager's own, in its
    order."""
    B, H, c, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    if causal:   # later keys are all masked for this chunk
        k, v = k[..., :q_offset + c, :], v[..., :q_offset + c, :]
        mask = mask[..., :q_offset + c] if mask is not None else None
    n = k.shape[-2]
    block = min(n, SOFTCAP_KEYS)
    scale = scale if scale is not None else D ** -0.5
    piece = max(1, softcap_scores(c, H) // max(1, B * H * block))
    out = q.new_empty(q.shape)
    positions = torch.arange(n, device=q.device) if causal else None   # keys' (and query rows') positions
    for r in range(0, c, piece):
        e = min(c, r + piece)
        qg = q[:, :, r:e].reshape(B, Hkv, rep * (e - r), D)
        merge = LseAccumulator(q[:, :, r:e]) if block < n else None
        rows_at = positions[q_offset + r:q_offset + e].unsqueeze(-1) if causal else None
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            s = torch.matmul(qg, k[..., s0:s1, :].transpose(-1, -2)).view(B, Hkv, rep, e - r, s1 - s0)
            s = s.mul_(scale).div_(softcap).tanh_().mul_(softcap)
            if causal:   # query row q_offset + r + i sees keys up to itself
                s.masked_fill_(positions[s0:s1] > rows_at, float("-inf"))
            if mask is not None:   # broadcastable to [B, H, c, n]: this piece's rows and block's keys, as a view
                m = mask[..., r:e, :] if mask.shape[-2] == c else mask
                m = m[..., s0:s1]
                m = m.unsqueeze(2) if m.shape[1] == 1 else m.unflatten(1, (Hkv, rep))
                s = s.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m)
            if merge is None:   # one block: eager's softmax over every key
                p = torch.softmax(s, dim=-1, dtype=torch.float32)
                del s
                p = p.to(q.dtype)
                out[:, :, r:e] = torch.matmul(p.view(B, Hkv, rep * (e - r), n), v).view(B, H, e - r, D)
                continue
            # this block's attention and log-sum-exp; a row that sees none of its keys has -inf (taken as nothing)
            top = s.amax(-1, keepdim=True).float()
            top = torch.where(torch.isinf(top), 0.0, top)
            p = s.float().sub_(top).exp_()
            del s
            total = p.sum(-1, keepdim=True)
            o = torch.matmul(p.to(q.dtype).view(B, Hkv, rep * (e - r), s1 - s0), v[..., s0:s1, :]).float()
            del p
            merge.add(o.view(B, H, e - r, D).div_(total.view(B, H, e - r, 1)),
                      (top + total.log()).view(B, H, e - r), masked=True)
        if merge is not None:
            merge.result(q.dtype, out[:, :, r:e])
    return out


class SDPAConsumer:
    name = "sdpa"

    def __init__(self, caps):
        self.caps = caps

    def workspace_row_bytes(self, *, heads: int, head_dim: int, elem: int, causal: bool, masked: bool,
                            device_type: str | None = None) -> int:
        """Per query row: an unmasked causal chunk after the first holds the past keys' partial output beside the
        diagonal block's (which becomes the output) and the fp32 copies of one head group's merge. On CPU (or where the
        device is not said) PyTorch's flash kernel keeps buffers of its own besides, counted as two fp32 outputs and two
        in the chunk's dtype per row."""
        if not causal or masked:
            return 0
        if device_type in ("cuda", "meta"):   # CUDA's fused kernels allocate their output and log-sum-exp alone
            return heads * head_dim * elem + merge_bytes_per_row(heads, head_dim, device_type)
        return heads * head_dim * (8 + 2 * elem)

    def workspace_bytes(self, *, rows: int, keys: int, heads: int, kv_heads: int, head_dim: int, elem: int,
                        causal: bool, masked: bool, device_type: str | None = None, softcap: float = 0.0,
                        sinks: bool = False) -> int:
        """Bytes ``attend`` allocates besides its output for one chunk of ``rows`` query rows against up to ``keys``
        keys, at its worst moment (the planner charges them while the chunk's attention runs). A causal chunk after the
        first: the diagonal block's output (with GQA on torch < 2.5 its repeated K/V heads), then the past keys' output
        (and there the grouped Q copy), then the merge's fp32 weights and head-group copies (the fused merge on CUDA
        needs none). Each fused call adds its log-sum-exp and, on CPU, the flash kernel's per-thread tiles, which scale
        with the thread count, not the rows."""
        if softcap:   # one piece of scores in the inputs' dtype beside its fp32 softmax and the fp32 copy softmax
            # makes of a bf16/fp16 input (or, merging key blocks, the fp32 exponentials then their cast back); a
            # boolean mask's negation for the piece's rows and keys; the merge's accumulator and a block's output
            scores = min(softcap_scores(rows, heads), heads * rows * keys)
            return scores * (elem + 8) + (scores // max(1, heads) if masked else 0) + (
                rows * heads * (head_dim + 1) * 4 * 2 if keys > SOFTCAP_KEYS else 0)
        if sinks:   # ``_with_sinks``: the fp32 math path's scores over the chunk's rows (in pieces of at most
            # MATH_SCORES) and their masked and exponentiated copies, then the fp32 output and its weights
            scores = min(rows * heads * keys, max(MATH_SCORES, heads * keys))
            return MATH_SCORES_HELD * 4 * scores + 2 * 4 * rows * heads * head_dim
        if masked:
            return self.workspace_row_bytes(heads=heads, head_dim=head_dim, elem=elem, causal=causal, masked=masked,
                                            device_type=device_type) * rows
        cpu = device_type not in ("cuda", "meta")

        def call(q_rows: int, k_rows: int, h: int) -> int:
            return 4 * h * q_rows + (_cpu_flash_tiles(q_rows, k_rows, head_dim, elem) if cpu else 0)

        if not causal or keys <= rows:   # one call: a non-causal chunk, or the first causal one (square block)
            return call(rows, keys, heads)
        rep = heads // max(1, kv_heads)
        out = heads * head_dim * elem * rows
        if _HAS_GQA:   # the kernels take the K/V heads as they are
            diag = call(rows, rows, heads)
            past = out + 4 * heads * rows + call(rows, keys, heads)
        else:          # the diagonal block's K/V heads repeated; the past's query heads grouped as rows (a copy)
            diag = (2 * out if rep > 1 else 0) + call(rows, rows, heads)
            past = (out if rep > 1 else 0) + out + 4 * heads * rows + call(rep * rows, keys, kv_heads)
        merge = out + merge_bytes_per_row(heads, head_dim, device_type) * rows
        return max(diag, past, merge)

    def _with_sinks(self, q, k, v, q_offset: int, causal: bool, mask, scale, sinks: torch.Tensor) -> torch.Tensor:
        """Attention sinks (GPT-OSS): a logit per head in every row's softmax that has no value. Merged by
        log-sum-exps it is one more block of keys whose output is nothing, so the attention over the real keys
        (``attend_lse``) times ``sigmoid(lse - sink)``; a row that sees no key gives zeros, as eager's does."""
        rows = q.shape[-2]
        if causal and not (q_offset == 0 and mask is None):   # a chunk past the first: its rows' keys, masked
            keys = q_offset + rows
            k, v = k[..., :keys, :], v[..., :keys, :]
            mask, causal = _with_causal_rows(mask, rows, keys, q_offset, q.device), False
        out, lse = self.attend_lse(q, k, v, causal=causal, mask=mask, scale=scale)
        w = torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
        return torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, out.float() * w).to(q.dtype)

    def attend_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   mask: torch.Tensor | None, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One K/V block (``kv_blocks_lse``): q [B, H, c, D] against k, v [B, Hkv, n, D] -> (output in q's dtype,
        log-sum-exp [B, H, c] in fp32). ``causal``: top-left aligned (query i sees the block's keys 0..i); ``mask``:
        [.., c, n], this block's columns. Fused kernels where they return their log-sum-exp, else fp32 math."""
        B, H, c, D = q.shape
        Hkv = k.shape[1]
        if mask is None:
            rep = H // Hkv
            if rep > 1 and not causal:   # heads sharing a K/V head as rows of one call: exact without a mask
                qg = _grouped(q, Hkv)
                got = _fused_with_lse(qg, k, v, False, scale)
                if got is not None:
                    return got[0].reshape(B, H, c, D), got[1].reshape(B, H, c)
            else:   # one K/V head per Q head (a causal block's K/V heads repeated: the block's size, not the rows')
                if rep > 1:
                    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                got = _fused_with_lse(q, k, v, causal, scale)
                if got is not None:
                    return got[0], got[1].float()
        return _math_with_lse(q, k, v, causal, mask, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, causal: bool,
               mask: torch.Tensor | None, scale: float | None, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if softcap:
            return _softcapped(q, k, v, q_offset, causal, mask, scale, softcap)
        if sinks is not None:
            return self._with_sinks(q, k, v, q_offset, causal, mask, scale, sinks)
        gqa = q.shape[1] != k.shape[1]
        if causal and mask is None and q_offset > 0:
            out = _causal_by_parts(q, k, v, q_offset, scale)
            if out is not None:
                return out
        if gqa and not _HAS_GQA:  # torch < 2.5: expand K/V heads (costs memory; newer torch does not)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        kw = {"enable_gqa": True} if gqa else {}
        if causal:
            rows = q.shape[-2]
            keys = q_offset + rows        # later keys are all masked for this chunk: leave them out
            k, v = k[..., :keys, :], v[..., :keys, :]
            if mask is None and q_offset == 0:   # the first chunk: a square causal block, stock's own call
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **kw)
            if mask is None and q.device.type == "cuda":
                from torch.nn.attention.bias import causal_lower_right
                return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(rows, keys),
                                                      scale=scale, **kw)
            mask = _with_causal_rows(mask, rows, keys, q_offset, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **kw)
