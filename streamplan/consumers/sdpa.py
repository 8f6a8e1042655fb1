"""PyTorch ``scaled_dot_product_attention`` as the baseline consumer: bounded Q, offset causal, GQA, masks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _causal_rows(rows: int, keys: int, offset: int, device: torch.device) -> torch.Tensor:
    """Boolean mask: query row offset+i sees keys 0..offset+i."""
    q = torch.arange(offset, offset + rows, device=device).unsqueeze(-1)
    return torch.arange(keys, device=device) <= q


class SDPAConsumer:
    name = "sdpa"

    def __init__(self, caps):
        self.caps = caps

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, causal: bool,
               mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if gqa and not _HAS_GQA:  # torch < 2.5: expand K/V heads (costs memory; newer torch does not)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        kw = {"enable_gqa": True} if gqa else {}
        if causal:
            rows = q.shape[-2]
            keys = q_offset + rows        # later keys are all masked for this chunk: leave them out
            k, v = k[..., :keys, :], v[..., :keys, :]
            if mask is None and q.device.type == "cuda":
                from torch.nn.attention.bias import causal_lower_right
                return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(rows, keys),
                                                      scale=scale, **kw)
            allowed = _causal_rows(rows, keys, q_offset, q.device)
            if mask is None:
                mask = allowed
            elif mask.dtype == torch.bool:
                mask = mask[..., :keys] & allowed
            else:
                mask = mask[..., :keys].masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **kw)
