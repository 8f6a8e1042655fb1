"""Ops that read a bounded reach of neighbouring rows (a halo), streamed by running each chunk on its rows widened by
that reach and keeping its own: LFM2's short causal convolution against transformers' own layer and model, and the
reach read off each convolution's kernel size, padding and dilation (never guessed)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamplan
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable

pytest.importorskip("transformers")

CPU = torch.device("cpu")



@torch.no_grad()
def test_lfm2_short_convolution_layer_streams_exactly_with_its_causal_halo():
    from streamplan.tools.catalogue.transformers_cases import CASES
    case = CASES["lfm2_conv"]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(1000, CPU, torch.float32)
    ref, stock_peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
    found, _ = streamable(layer, args, kwargs, 1000)
    kernel = layer.conv.conv_kernel_size
    assert found.analysis.halo == (kernel - 1, 0)   # causal: the kernel's reach before each row, none after
    with streamed(layer, chunk_tokens=64) as handle:
        out, peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
        assert handle.plans[""][0].tier == "L1", handle.report()
        o, r = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)
        assert rel_err(o, r) <= 1e-5
        assert peak < 0.5 * stock_peak, (peak, stock_peak)


@torch.no_grad()
def test_a_whole_lfm2_prefill_streams_its_convolution_layers_exactly():
    from transformers import Lfm2Config, Lfm2ForCausalLM
    cfg = Lfm2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, vocab_size=128, layer_types=["conv", "full_attention", "conv", "conv"],
                     conv_L_cache=3)
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 600))
    ref = model(ids, use_cache=False).logits
    with streamed(model, chunk_tokens=64) as handle:
        out = model(ids, use_cache=False).logits
        assert rel_err(out, ref) <= 1e-5
        for i in (0, 2, 3):
            plans = handle.plans.get(f"model.layers.{i}") or []
            assert plans and all(p.tier == "L1" for p in plans), handle.report()


class _ConvBlock(nn.Module):
    """A gated depthwise convolution along the rows between two projections, ``padding`` as given."""

    def __init__(self, kernel: int, padding, dilation: int = 1, stride: int = 1):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 64), nn.Linear(32, 32)
        self.conv = nn.Conv1d(32, 32, kernel, stride=stride, padding=padding, dilation=dilation, groups=32)

    def forward(self, x):
        g, h = self.inp(x).chunk(2, dim=-1)
        y = self.conv(h.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return x + self.out(F.silu(g) * y)


@pytest.mark.parametrize("kernel,padding,dilation,halo", [(5, "same", 2, (4, 4)), (3, 1, 1, (1, 1)),
                                                          (4, 3, 1, (3, 0)), (3, 4, 2, (4, 0))])
@torch.no_grad()
def test_the_halo_is_read_off_the_convolution(kernel, padding, dilation, halo):
    torch.manual_seed(0)
    block = _ConvBlock(kernel, padding, dilation).eval()
    x = torch.randn(1, 300, 32)
    ref = block(x)
    found, _ = streamable(block, (x,), {}, 300)
    assert found.analysis.halo == halo
    with streamed(block, chunk_tokens=32) as handle:
        out = block(x)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert rel_err(out, ref) <= 1e-5


class _ConvThenAttention(_ConvBlock):
    def forward(self, x):
        x = super().forward(x)
        q = k = v = x.unflatten(-1, (2, 16)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


@torch.no_grad()
def test_a_convolution_in_a_block_with_a_global_attention_is_refused_named():
    """Widening every chunk by the halo is exact only where a chunk reads nothing but its rows: K and V over every
    row would be built from chunks whose edges are wrong."""
    torch.manual_seed(0)
    x = torch.randn(1, 300, 32)
    found, _ = streamable(_ConvThenAttention(3, 2).eval(), (x,), {}, 300)
    assert isinstance(found, str) and "a convolution along the rows in a block with a global attention" in found, found
