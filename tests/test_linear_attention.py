"""Contractions over every row (linear attention's ``V^T K`` state, a mean over the rows): computed in phase KV from
their inputs built whole, as K and V are, then read by every Q chunk; refused, named, where an input is not a phase-KV
value. Against diffusers' own Sana linear-attention processor."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamplan
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable

pytest.importorskip("diffusers")

CPU = torch.device("cpu")


class _LinearAttentionLayer(nn.Module):
    """diffusers' ``Attention`` with Sana's linear processor (ReLU feature maps, the state over every row), between a
    norm and the residual."""

    def __init__(self):
        super().__init__()
        from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
        self.norm = nn.LayerNorm(64)
        self.attn = Attention(query_dim=64, heads=4, dim_head=16, bias=True,
                              processor=SanaLinearAttnProcessor2_0())

    def forward(self, x):
        return x + self.attn(self.norm(x))


@torch.no_grad()
def test_sana_linear_attention_streams_exactly_with_its_state_built_in_phase_kv():
    torch.manual_seed(0)
    layer = _LinearAttentionLayer().eval()
    x = torch.randn(1, 3000, 64)
    ref, stock_peak = streamplan.measure_peak(lambda: layer(x), device=CPU)
    found, _ = streamable(layer, (x,), {}, 3000)
    (c,) = found.analysis.contractions
    assert c.node.meta["val"].shape[-2:] == (17, 16)     # [.., head_dim + 1 (the normaliser), head_dim]: no rows
    with streamed(layer, chunk_tokens=256) as handle:
        out, peak = streamplan.measure_peak(lambda: layer(x), device=CPU)
        (plan,) = handle.plans[""]
        assert plan.tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5
    floor = 3 * x.numel() * 4
    assert peak < stock_peak and peak <= 1.6 * floor, (peak / floor, stock_peak / floor)


class _Centred(nn.Module):
    """Rows centred on their mean over every row (a sum over the rows), then an MLP."""

    def __init__(self, after_attention: bool = False):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 64), nn.Linear(64, 32)
        self.after_attention = after_attention

    def forward(self, x):
        if self.after_attention:
            q = k = v = x.unflatten(-1, (2, 16)).transpose(1, 2)
            x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        h = self.inp(x)
        h = h - h.mean(dim=1, keepdim=True)
        return x + self.out(F.gelu(h))


@torch.no_grad()
def test_a_mean_over_every_row_is_computed_once_in_phase_kv():
    torch.manual_seed(0)
    block = _Centred().eval()
    x = torch.randn(2, 500, 32)
    ref = block(x)
    with streamed(block, chunk_tokens=64) as handle:
        out = block(x)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5


@torch.no_grad()
def test_a_contraction_over_an_attentions_output_stays_stock_named():
    """Its input is not a phase-KV value: every row of the attention's output would be needed before phase Q."""
    torch.manual_seed(0)
    block = _Centred(after_attention=True).eval()
    x = torch.randn(1, 300, 32)
    found, _ = streamable(block, (x,), {}, 300)
    assert isinstance(found, str) and "a contraction over the rows of values an attention" in found, found


@torch.no_grad()
def test_a_contraction_over_a_halo_stays_stock_named():
    torch.manual_seed(0)

    class _ConvThenSum(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(32, 32, 3, padding=1, groups=32)

        def forward(self, x):
            h = self.conv(x.transpose(1, 2)).transpose(1, 2)
            return x + h.sum(dim=1, keepdim=True)

    x = torch.randn(1, 300, 32)
    found, _ = streamable(_ConvThenSum().eval(), (x,), {}, 300)
    assert isinstance(found, str) and "a convolution's halo feeds" in found, found
