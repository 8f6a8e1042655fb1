"""A block's parts that no recognizer knows but that look like blocks themselves (here an MLP in a ``Sequential``)
stream from their own captured graphs on the calls their block runs stock, and are never captured while the block
streams whole (``recognize.generic.part_candidates``). The attention is diffusers' own; the block around it is this
test's, since what is tested is the walk, not a library's structure."""
import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from diffusers.models.attention_processor import Attention  # noqa: E402

import streamplan  # noqa: E402
from conftest import rel_err, streamed  # noqa: E402


class _Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(query_dim=dim, heads=2, dim_head=dim // 2)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.ffn(x)


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleList([_Block(), _Block()])


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = _blocks()

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@torch.no_grad()
def test_an_unknown_part_is_not_captured_while_its_block_streams_whole():
    model, x = _Model().eval(), torch.randn(1, 512, 32)
    ref = model(x)
    with streamed(model, chunk_tokens=128) as handle:
        out = model(x)
        report = handle.report()
        assert handle.plans["blocks.0"][0].tier == "L1", report
        assert not handle.plans.get("blocks.0.ffn") and not handle.plans.get("blocks.1.ffn"), report
    assert rel_err(out, ref) <= 1e-5, report


@torch.no_grad()
def test_a_block_left_stock_streams_its_unknown_part_from_its_own_graph_exactly():
    model, x = _Model().eval(), torch.randn(1, 512, 32)
    hooked = model.blocks[0].register_forward_hook(lambda m, a, o: None)   # a hook: the block keeps its stock path
    ref, stock = streamplan.measure_peak(model, x)
    with streamed(model, chunk_tokens=128) as handle:
        out, peak = streamplan.measure_peak(model, x)
        report = handle.report()
        plans = handle.plans
        assert plans["blocks.0.ffn"][0].tier == "L1" and plans["blocks.0.ffn"][0].chunk == 128, report
        assert "captured torch.Sequential" in report and "(else its parts)" in report, report
        assert plans["blocks.1"][0].tier == "L1" and not plans.get("blocks.1.ffn"), report
    hooked.remove()
    assert rel_err(out, ref) <= 1e-5, report
    assert peak < stock, (peak, stock)
