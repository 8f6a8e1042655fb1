"""A block that reads the row count off its [B, 1, N, N] mask (OmniGen's attention does, through export's choice of
the symbol's source): the size of the mask's key dimension, which a Q chunk keeps whole, counts the chunk's rows."""
import torch
import torch.nn.functional as F
from torch import nn

import streamplan


class SizedByMask(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        n = mask.shape[-1]          # the row count, read off the mask's keys
        b, _, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d)
        return x + self.out(o)


@torch.no_grad()
def test_row_count_read_off_a_mask_streams_exactly():
    torch.manual_seed(0)
    n = 200
    block = SizedByMask().eval()
    x = torch.randn(1, n, 32)
    allowed = torch.ones(n, n).tril()
    allowed[16:, 16:] = 1
    mask = ((1 - allowed) * torch.finfo(torch.float32).min)[None, None]
    ref = block(x, mask)
    handle = streamplan.apply(block, chunk_tokens=64, capture="prefer")
    try:
        out = block(x, mask)
        assert [p.tier for p in handle.plans[""]] == ["L1"], handle.report()
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    finally:
        handle.remove()
