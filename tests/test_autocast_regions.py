"""Autocast regions that turn autocast off, taken into the graph as plain ops (``graph/autocast_regions.py``):
Z-Image's rotary runs inside ``torch.amp.autocast("cuda", enabled=False)``; against its own forward, fp32 on CPU.
Under an enabled autocast for the region's device the block keeps its stock path, named."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import rel_err, streamed  # noqa: E402

CPU = torch.device("cpu")



@torch.no_grad()
def test_zimage_streams_with_its_rotary_autocast_region():
    pytest.importorskip("diffusers")
    from streamplan.tools.catalogue.diffusers_cases import CASES
    case = CASES["zimage"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(400, CPU, torch.float32)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=64) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5


class _RegionBlock(nn.Module):
    """Attention whose query/key scaling runs with CPU autocast turned off, as Z-Image's rotary does for CUDA."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        with torch.autocast("cpu", enabled=False):
            q, k = q.float() * 1.5, k.float().tanh()
        o = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v)
        return x + self.out(o.transpose(1, 2).flatten(2))


@torch.no_grad()
def test_a_region_turning_autocast_off_streams_and_under_autocast_stays_stock_named():
    torch.manual_seed(0)
    block = _RegionBlock().eval()
    x = torch.randn(1, 256, 32)
    ref = block(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_autocast = block(x)
    with streamed(block, chunk_tokens=64) as handle:
        out = block(x)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_autocast = block(x)
        assert torch.equal(out_autocast, ref_autocast)
        assert "runs under an enabled autocast for cpu" in handle.report(), handle.report()
