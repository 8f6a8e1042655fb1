"""Streamed MLPs against the real diffusers / transformers modules' own forward."""
import pytest
import torch
from diffusers.models.attention import FeedForward
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

import streamplan
from conftest import rel_err

DIFFUSERS_ACTS = ["gelu", "gelu-approximate", "geglu", "geglu-approximate", "swiglu", "linear-silu"]
SHAPES = [(1, 1000, 64), (3, 77, 64), (2, 130, 64)]  # rows not a multiple of the chunk, and rows < chunk


def _llama_family():
    kw = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2)
    return [LlamaMLP(LlamaConfig(**kw)), LlamaMLP(LlamaConfig(**kw, mlp_bias=True)), MistralMLP(MistralConfig(**kw)),
            Qwen2MLP(Qwen2Config(**kw)), Qwen3MLP(Qwen3Config(**kw, hidden_act="gelu_pytorch_tanh"))]


def _all_mlps():
    mlps = [FeedForward(64, mult=3, activation_fn=a) for a in DIFFUSERS_ACTS]
    mlps.append(FeedForward(64, dim_out=48, mult=2, activation_fn="geglu", bias=False, final_dropout=True))
    return [m.eval() for m in mlps + _llama_family()]


@pytest.mark.parametrize("mlp", _all_mlps(), ids=lambda m: f"{type(m).__name__}")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", [dict(chunk_tokens=128), dict(chunk_tokens=4096), dict(chunk_tokens=96, ffn_slice=40),
                                  dict(ffn_slice=64)], ids=["rows", "chunk>input", "rows+features", "features"])
@torch.no_grad()
def test_streamed_matches_the_real_module(mlp, shape, mode):
    x = torch.randn(shape)
    ref = mlp(x)
    handle = streamplan.apply(mlp, **mode)
    assert len(handle.installed) == 1, handle.report()
    out = mlp(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) <= 1e-5
    plan = handle.plans[""][0]
    rows = shape[0] * shape[1]
    if "ffn_slice" in mode:
        assert plan.tier == "L2"
    else:
        assert plan.tier == ("L1" if rows > mode["chunk_tokens"] else "L0")
    handle.remove()
    assert torch.equal(mlp(x), ref)


@torch.no_grad()
def test_remove_restores_the_same_function_objects():
    ff = FeedForward(32, activation_fn="geglu").eval()
    before = ff.forward
    assert "forward" not in ff.__dict__
    handle = streamplan.apply(ff, chunk_tokens=8)
    assert "forward" in ff.__dict__
    handle.remove()
    assert "forward" not in ff.__dict__ and ff.forward.__func__ is before.__func__


@torch.no_grad()
def test_whole_model_streams_every_mlp_and_reports():
    model = torch.nn.Sequential(FeedForward(32, activation_fn="gelu"), torch.nn.LayerNorm(32),
                                FeedForward(32, activation_fn="swiglu")).eval()
    x = torch.randn(2, 50, 32)
    ref = model(x)
    handle = streamplan.apply(model, chunk_tokens=16)
    assert set(handle.installed) == {"0", "2"}
    assert rel_err(model(x), ref) <= 1e-5
    text = handle.report()
    assert "\n  0 " in text and "L1 rows=100 chunk=16" in text
    assert handle.to_json()
    assert "forward" in model.__dict__            # the root's forward is tracked while applied ...
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())   # ... and every forward is back


def test_variants_left_stock_are_named():
    train = FeedForward(32, activation_fn="gelu")  # training mode
    hooked = FeedForward(32, activation_fn="gelu").eval()
    hooked.net[2].register_forward_hook(lambda *a: None)
    odd = FeedForward(32, activation_fn="gelu").eval()
    odd.net[0] = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Softmax(-1))
    patched = FeedForward(32, activation_fn="gelu").eval()
    patched.forward = lambda x: x
    handle = streamplan.apply(torch.nn.ModuleDict(dict(in_training=train, hooked=hooked, odd=odd, patched=patched)))
    assert handle.installed == {}
    reasons = {s.name: s.reason for s in handle.skipped}
    assert "training mode" in reasons["in_training"]
    assert "hook" in reasons["hooked"]
    assert "Sequential" in reasons["odd"]
    assert "patched" in reasons["patched"]
    text = handle.report()
    for name in reasons:
        assert f"stock     {name}" in text


def test_nothing_recognised_leaves_the_model_untouched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    state = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    handle = streamplan.apply(model)
    assert "nothing recognised" in handle.report()
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == state


@pytest.mark.parametrize("kwargs, arg", [(dict(chunk_tokens=0), "chunk_tokens"),
                                         (dict(chunk_tokens=-3), "chunk_tokens"),
                                         (dict(chunk_tokens=1.5), "chunk_tokens"), (dict(budget="12 GiBs"), "budget"),
                                         (dict(budget="lots"), "budget"), (dict(budget=-1), "budget"),
                                         (dict(ffn_slice=0), "ffn_slice")])
def test_bad_arguments_raise_naming_the_argument(kwargs, arg):
    ff = FeedForward(16).eval()
    with pytest.raises(ValueError, match=arg):
        streamplan.apply(ff, **kwargs)
    assert "forward" not in ff.__dict__


def test_non_module_is_rejected():
    with pytest.raises(ValueError, match="module"):
        streamplan.apply(lambda x: x)


@torch.no_grad()
def test_autograd_falls_back_to_stock():
    ff = FeedForward(16, activation_fn="gelu").eval()
    x = torch.randn(1, 40, 16, requires_grad=True)
    handle = streamplan.apply(ff, chunk_tokens=8)
    with torch.enable_grad():
        ff(x).sum().backward()
    assert x.grad is not None
    assert "autograd" in handle.report()


@torch.no_grad()
def test_streamed_feedforward_peaks_far_below_stock():
    ff = FeedForward(512, mult=4).eval()
    x = torch.randn(1, 8192, 512)
    ref, stock = streamplan.measure_peak(ff, x)
    assert stock >= 192 * 2**20
    handle = streamplan.apply(ff, chunk_tokens=1024)
    out, rows = streamplan.measure_peak(ff, x)
    assert rows <= 0.30 * stock
    handle.remove()
    handle = streamplan.apply(ff, chunk_tokens=1024, ffn_slice=512)
    out2, sliced = streamplan.measure_peak(ff, x)
    assert sliced < rows
    assert rel_err(out, ref) <= 1e-5 and rel_err(out2, ref) <= 1e-5
    # the planner's prediction is checked against the meter
    plan = handle.plans[""][0]
    assert abs(plan.predicted_peak - sliced) <= 0.15 * sliced
