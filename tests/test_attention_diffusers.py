"""Streamed attention against the real diffusers modules' own forward: ``Attention`` (AttnProcessor2_0),
``WanAttention`` (WanAttnProcessor) and ``FluxAttention`` (FluxAttnProcessor).

The oracle is always the module itself: stock output first, then streamed (max relative error 1e-5 in fp32),
then ``handle.remove()`` and stock again (bit-identical). A spy on the SDPA consumer counts the Q chunks, so a
test cannot pass by silently running stock.
"""
import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

import streamplan
from conftest import rel_err
from streamplan.attention import SDPA
from streamplan.execute.chunk_loop import chunk_bounds

DIM, HEADS, HEAD_DIM = 64, 4, 16
CROSS_DIM, ENC_TOKENS, WAN_TEXT = 32, 7, 13

# (batch, tokens, chunk): tokens not a multiple of the chunk, batch 1 and 3, and a chunk larger than every row
# count (the Flux joint sequence included), which plans L0 and streams nothing.
SHAPES = [(1, 100, 33), (3, 100, 33), (2, 257, 64), (2, 100, 128)]
SHAPE_IDS = ["B1-N100-c33", "B3-N100-c33", "B2-N257-c64", "B2-N100-chunk>rows"]


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def q_chunks(monkeypatch):
    """Row counts of every Q chunk the SDPA consumer attends (the streamed path, never the stock one)."""
    seen = []
    attend = SDPA.attend

    def spy(q, k, v, **kw):
        seen.append(q.shape[-2])
        return attend(q, k, v, **kw)

    monkeypatch.setattr(SDPA, "attend", spy)
    return seen


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _assert_close(out, ref):
    out, ref = _as_tuple(out), _as_tuple(ref)
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= 1e-5


def _assert_equal(out, ref):
    out, ref = _as_tuple(out), _as_tuple(ref)
    assert len(out) == len(ref) and all(torch.equal(o, r) for o, r in zip(out, ref))


def _expected_chunks(segment_rows, chunk, least=1):
    return [b - a for rows in segment_rows for a, b in chunk_bounds(rows, chunk, least)]


def _check_streamed(module, args, kwargs, chunk, segment_rows, q_chunks):
    """Stock, streamed, stock again; the plan and the Q chunks the consumer actually saw."""
    ref = module(*args, **kwargs)
    handle = streamplan.apply(module, chunk_tokens=chunk)
    assert list(handle.installed) == [""] and handle.skipped == [], handle.report()
    out = module(*args, **kwargs)
    _assert_close(out, ref)
    assert [n for n in handle.installed[""].runtime_notes if not n.startswith("captured in")] == [], handle.report()
    (plan,) = handle.plans[""]
    rows = sum(segment_rows)
    captured = handle.installed[""].spec.label.startswith("captured")
    if captured:   # a graph chunks its own rows; static rows joined to them (Flux's text) ride in its first chunk
        assert plan.rows == segment_rows[-1]
        expected = _expected_chunks(segment_rows[-1:], chunk, least=2)   # a graph holds from two rows
        expected[0] += rows - segment_rows[-1]
        if getattr(module, "is_cross_attention", False):
            expected = []   # attention to text is row-local: it runs inside the graph, not through the consumer
    else:
        assert plan.rows == rows
        expected = _expected_chunks(segment_rows, chunk)
    if plan.rows > chunk:
        assert plan.tier == "L1" and plan.chunk == chunk
        assert q_chunks == expected
        assert plan.predicted_peak < plan.stock_peak
    else:
        assert plan.tier == "L0" and q_chunks == []
        _assert_equal(out, ref)  # L0 is the stock forward itself
    handle.remove()
    assert "forward" not in module.__dict__
    _assert_equal(module(*args, **kwargs), ref)
    return handle


@torch.no_grad()
def _random_norms(module):
    """Norm weights start at 1 and biases at 0: randomise them, so a skipped or swapped norm would show."""
    for name, p in module.named_parameters():
        if "norm" in name:
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    return module.eval()


def _attention(**kw):
    return _random_norms(Attention(DIM, heads=HEADS, dim_head=HEAD_DIM, **kw))


def _wan(**kw):
    return _random_norms(WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, processor=WanAttnProcessor(), **kw))


def _flux_double():
    return _random_norms(FluxAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, added_kv_proj_dim=DIM, out_dim=DIM,
                                       context_pre_only=False, bias=True, eps=1e-6, processor=FluxAttnProcessor()))


def _flux_single():
    return _random_norms(FluxAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, bias=True, eps=1e-6,
                                       pre_only=True, processor=FluxAttnProcessor()))


def _fused(module):
    module.fuse_projections()
    assert module.fused_projections
    return module


def _padding_mask(B, S):
    """Boolean [B, S]: True attends; every batch keeps some keys."""
    keep = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        keep[b, max(1, S - 2 * (b + 1)):] = False
    return keep


def _additive_mask(*shape):
    """Float mask: random biases, some -inf (column 0 always open, so no row is fully masked)."""
    m = torch.randn(*shape)
    m[torch.rand(*shape) < 0.2] = float("-inf")
    m[..., 0] = 0.0
    return m


# ---------------------------------------------------------------------------------------------------------
# 1. diffusers Attention with AttnProcessor2_0
# ---------------------------------------------------------------------------------------------------------
def _enc(B):
    return torch.randn(B, ENC_TOKENS, CROSS_DIM)


ATTENTION_CASES = {
    "self": lambda B, N: (_attention(), (torch.randn(B, N, DIM),), {}),
    "qk-rms_norm": lambda B, N: (_attention(qk_norm="rms_norm"), (torch.randn(B, N, DIM),), {}),
    "qk-layer_norm": lambda B, N: (_attention(qk_norm="layer_norm"), (torch.randn(B, N, DIM),), {}),
    "qk-fp32_layer_norm": lambda B, N: (_attention(qk_norm="fp32_layer_norm"), (torch.randn(B, N, DIM),), {}),
    "residual+rescale": lambda B, N: (_attention(residual_connection=True, rescale_output_factor=2.0),
                                      (torch.randn(B, N, DIM),), {}),
    "self-bool-padding-mask": lambda B, N: (_attention(), (torch.randn(B, N, DIM),),
                                            dict(attention_mask=_padding_mask(B, N))),
    "self-per-query-additive-mask": lambda B, N: (_attention(), (torch.randn(B, N, DIM), None,
                                                                 _additive_mask(B, N, N)), {}),
    # HunyuanVideo's token refiner hands its attention a [B, 1, N, N] mask: sliced by query rows per chunk
    "self-per-query-4d-additive-mask": lambda B, N: (_attention(), (torch.randn(B, N, DIM), None,
                                                                    _additive_mask(B, 1, N, N)), {}),
    "cross": lambda B, N: (_attention(cross_attention_dim=CROSS_DIM), (torch.randn(B, N, DIM), _enc(B)), {}),
    "cross-bool-padding-mask": lambda B, N: (_attention(cross_attention_dim=CROSS_DIM),
                                             (torch.randn(B, N, DIM), _enc(B), _padding_mask(B, ENC_TOKENS)), {}),
    "cross-additive-mask": lambda B, N: (_attention(cross_attention_dim=CROSS_DIM), (torch.randn(B, N, DIM),),
                                         dict(encoder_hidden_states=_enc(B),
                                              attention_mask=_additive_mask(B, ENC_TOKENS))),
    "cross-norm_cross+qk_norm+residual": lambda B, N: (
        _attention(cross_attention_dim=CROSS_DIM, cross_attention_norm="layer_norm", qk_norm="rms_norm",
                   residual_connection=True, rescale_output_factor=2.0),
        (torch.randn(B, N, DIM), _enc(B)), {}),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@torch.no_grad()
def test_attention_streamed_matches_the_real_module(case, shape, q_chunks):
    B, N, chunk = shape
    module, args, kwargs = ATTENTION_CASES[case](B, N)
    assert type(module.processor) is AttnProcessor2_0
    _check_streamed(module, args, kwargs, chunk, [N], q_chunks)


@torch.no_grad()
def test_attention_plan_and_report():
    attn = _attention()
    x = torch.randn(2, 100, DIM)
    handle = streamplan.apply(attn, chunk_tokens=33)
    attn(x)
    attn(torch.randn(2, 20, DIM))  # a second shape: planned separately, L0 (chunk > rows)
    plans = handle.plans[""]
    assert [(p.tier, p.rows, p.chunk) for p in plans] == [("L1", 100, 33), ("L0", 20, 20)]
    text = handle.report()
    assert "<root>" in text and "diffusers.Attention[AttnProcessor2_0]" in text
    assert "L1 rows=100 chunk=33" in text and "L0 stock  rows=20" in text
    assert handle.to_json()


# ---------------------------------------------------------------------------------------------------------
# 2. WanAttention with WanAttnProcessor
# ---------------------------------------------------------------------------------------------------------
def _wan_rotary(N):
    return torch.randn(1, N, 1, HEAD_DIM), torch.randn(1, N, 1, HEAD_DIM)


def _wan_text(B):
    return torch.randn(B, WAN_TEXT, DIM)


WAN_CASES = {
    "self-rotary": lambda B, N: (_wan(), (torch.randn(B, N, DIM),), dict(rotary_emb=_wan_rotary(N))),
    "self": lambda B, N: (_wan(), (torch.randn(B, N, DIM),), {}),
    "self-fused-rotary": lambda B, N: (_fused(_wan()), (torch.randn(B, N, DIM),), dict(rotary_emb=_wan_rotary(N))),
    "self-fused": lambda B, N: (_fused(_wan()), (torch.randn(B, N, DIM),), {}),
    "cross": lambda B, N: (_wan(is_cross_attention=True), (torch.randn(B, N, DIM), _wan_text(B)), {}),
    "cross-fused": lambda B, N: (_fused(_wan(is_cross_attention=True)), (torch.randn(B, N, DIM),),
                                 dict(encoder_hidden_states=_wan_text(B))),
    "cross-bool-mask": lambda B, N: (_wan(is_cross_attention=True), (torch.randn(B, N, DIM), _wan_text(B)),
                                     dict(attention_mask=_padding_mask(B, WAN_TEXT)[:, None, None, :])),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("case", list(WAN_CASES))
@torch.no_grad()
def test_wan_streamed_matches_the_real_module(case, shape, q_chunks):
    B, N, chunk = shape
    module, args, kwargs = WAN_CASES[case](B, N)
    assert type(module.processor) is WanAttnProcessor
    _check_streamed(module, args, kwargs, chunk, [N], q_chunks)


WAN_FUSED_BUG = pytest.mark.xfail(strict=True, raises=AttributeError, reason=(
    "streamplan bug: _bind_wan picks the fused projection by `encoder_hidden_states is not None`, diffusers by "
    "attn.is_cross_attention: a fused module called the other way raises AttributeError (to_kv / to_qkv) "
    "instead of matching stock or running stock"))


@pytest.mark.parametrize("cross_module", [pytest.param(False, id="self-module-given-encoder"),
                                          pytest.param(True, id="cross-module-given-no-encoder",
                                                       )])
@torch.no_grad()
def test_wan_fused_called_against_its_cross_flag(cross_module):
    wan = _fused(_wan(is_cross_attention=cross_module))
    args = (torch.randn(2, 50, DIM),) if cross_module else (torch.randn(2, 50, DIM), _wan_text(2))
    ref = wan(*args)  # diffusers: to_q + to_kv(hidden) / to_qkv(hidden), encoder ignored
    handle = streamplan.apply(wan, chunk_tokens=16)
    _assert_close(wan(*args), ref)
    handle.remove()


@torch.no_grad()
def test_wan_i2v_cross_attention_streams_from_its_graph():
    """Image-context (I2V) cross-attention: row-local (its keys are the image and text tokens), captured whole."""
    i2v = WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, added_kv_proj_dim=DIM, cross_attention_dim_head=HEAD_DIM,
                       processor=WanAttnProcessor()).eval()
    x = torch.randn(2, 40, DIM)
    enc = torch.randn(2, 4 + 512, DIM)  # 4 image-context tokens, then the 512 text tokens Wan hardcodes
    ref = i2v(x, enc)
    handle = streamplan.apply(i2v, chunk_tokens=16)
    _assert_close(i2v(x, enc), ref)
    (plan,) = handle.plans[""]
    assert plan.tier == "L1" and plan.chunk == 16, handle.report()
    handle.remove()
    assert "forward" not in i2v.__dict__ and torch.equal(i2v(x, enc), ref)


MASKS_OVER_ROWS = {
    "wan-additive-rows-x-rows": (lambda: _wan(), lambda: ((torch.randn(2, 60, DIM), None,
                                                           _additive_mask(2, 1, 60, 60), _wan_rotary(60)), {}),
                                 "2 row dimensions"),
    "flux-text-padding-over-joint-keys": (lambda: _flux_double(), lambda: _flux_joint(False, 12, mask=True)(2, 60)[1:3],
                                          "mask over the rows' keys"),
}


@pytest.mark.parametrize("case", list(MASKS_OVER_ROWS))
@torch.no_grad()
def test_masks_over_rows_stream_from_the_graph(case, q_chunks):
    """Masks whose keys are the streamed rows ([B, 1, N, N] additive, a key mask over joint text + image keys) stream
    from the captured graph: the mask's query rows taken per chunk, its keys whole; the output is stock's."""
    build, inputs, _ = MASKS_OVER_ROWS[case]
    module = build()
    args, kwargs = inputs()
    ref = module(*args, **kwargs)
    handle = streamplan.apply(module, chunk_tokens=16)
    _assert_close(module(*args, **kwargs), ref)
    plans = [p for ps in handle.plans.values() for p in ps]
    assert plans and all(p.tier == "L1" and p.chunk == 16 for p in plans), handle.report()
    assert len(q_chunks) > 1, handle.report()
    handle.remove()
    _assert_equal(module(*args, **kwargs), ref)


# ---------------------------------------------------------------------------------------------------------
# 3. FluxAttention with FluxAttnProcessor
# ---------------------------------------------------------------------------------------------------------
def _flux_rotary(rows):
    return torch.randn(rows, HEAD_DIM), torch.randn(rows, HEAD_DIM)


def _flux_joint(fused, T, rotary=True, mask=False):
    def make(B, N):
        module = _fused(_flux_double()) if fused else _flux_double()
        kwargs = dict(encoder_hidden_states=torch.randn(B, T, DIM))
        if rotary:
            kwargs["image_rotary_emb"] = _flux_rotary(T + N)
        if mask:  # text padding: the last text tokens of batch 0 are masked for every query
            m = torch.ones(B, 1, 1, T + N, dtype=torch.bool)
            m[0, ..., T - 3:T] = False
            kwargs["attention_mask"] = m
        return module, (torch.randn(B, N, DIM),), kwargs, [T, N]
    return make


def _flux_single_case(fused, rotary=True):
    def make(B, N):
        module = _fused(_flux_single()) if fused else _flux_single()
        kwargs = dict(image_rotary_emb=_flux_rotary(N)) if rotary else {}
        return module, (torch.randn(B, N, DIM),), kwargs, [N]
    return make


FLUX_CASES = {
    "double-T9": _flux_joint(False, 9),
    "double-T12": _flux_joint(False, 12),
    "double-fused-T9": _flux_joint(True, 9),
    "double-fused-T12": _flux_joint(True, 12),
    "double-T9-no-rotary": _flux_joint(False, 9, rotary=False),
    "single": _flux_single_case(False),
    "single-fused": _flux_single_case(True),
    "single-no-rotary": _flux_single_case(False, rotary=False),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("case", list(FLUX_CASES))
@torch.no_grad()
def test_flux_streamed_matches_the_real_module(case, shape, q_chunks):
    B, N, chunk = shape
    module, args, kwargs, segment_rows = FLUX_CASES[case](B, N)
    assert type(module.processor) is FluxAttnProcessor
    ref = module(*args, **kwargs)
    assert isinstance(ref, tuple) == ("encoder_hidden_states" in kwargs)  # (hidden, encoder) for the double block
    _check_streamed(module, args, kwargs, chunk, segment_rows, q_chunks)


# ---------------------------------------------------------------------------------------------------------
# 4. fail closed
# ---------------------------------------------------------------------------------------------------------
class _MyAttnProcessor(AttnProcessor2_0):
    pass


class _DoubledWanProcessor(WanAttnProcessor):
    """Different math under a new processor class: a captured graph of the old one must not be reused."""

    def __call__(self, *args, **kwargs):
        return 2 * super().__call__(*args, **kwargs)


def _call_args(module):
    if isinstance(module, FluxAttention) and module.added_kv_proj_dim is not None:
        return (torch.randn(2, 30, DIM), torch.randn(2, 5, DIM))
    return (torch.randn(2, 30, DIM),)


def _stock_variants():
    hooked = _attention()
    hooked.register_forward_hook(lambda m, i, o: o)
    return {
        "attn_AttnProcessor": (_attention(processor=AttnProcessor()), "processor AttnProcessor"),
        "attn_subclass": (_attention(processor=_MyAttnProcessor()), "processor _MyAttnProcessor"),
        "attn_training": (Attention(DIM, heads=HEADS, dim_head=HEAD_DIM), "training mode"),
        "attn_forward_hook": (hooked, "forward hooks"),
        "attn_l2_qk_norm": (_attention(qk_norm="l2"), "Q/K norm"),
    }


@torch.no_grad()
def test_unknown_variants_are_left_stock_and_named():
    variants = _stock_variants()
    modules = {name: m for name, (m, _) in variants.items()}
    inputs = {name: _call_args(m) for name, m in modules.items()}
    refs = {name: modules[name](*inputs[name]) for name in modules}
    before = {name: m.__dict__.get("forward") for name, m in modules.items()}
    handle = streamplan.apply(torch.nn.ModuleDict(modules), chunk_tokens=8)
    assert handle.installed == {}, handle.report()
    reasons = {s.name: s.reason for s in handle.skipped}
    assert set(reasons) == set(modules)
    text = handle.report()
    for name, (_, why) in variants.items():
        assert why in reasons[name], (name, reasons[name])
        assert f"stock     {name}" in text
        assert modules[name].__dict__.get("forward") is before[name]
        _assert_equal(modules[name](*inputs[name]), refs[name])


@torch.no_grad()
def test_a_second_apply_replans_and_either_handle_restores_stock():
    attn = _attention()
    x = torch.randn(1, 50, DIM)
    ref = attn(x)
    stock_forward = attn.forward
    first = streamplan.apply(attn, chunk_tokens=16)
    second = streamplan.apply(attn, chunk_tokens=8)
    assert list(second.installed) == [""] and second.skipped == []
    _assert_close(attn(x), ref)
    assert [p.chunk for p in second.plans[""]] == [8]       # the newer arguments hold
    assert first.installed == {} and "superseded" in first.report()
    first.remove()                                           # the older handle still gives stock back
    assert second.removed and attn.forward == stock_forward and "forward" not in attn.__dict__
    assert torch.equal(attn(x), ref)


def _processor_swaps():
    x = torch.randn(2, 50, DIM)
    return {
        "attention->AttnProcessor": (_attention(), (x,), {}, AttnProcessor()),
        "attention->subclass": (_attention(qk_norm="rms_norm"), (x,), {}, _MyAttnProcessor()),
    }


@pytest.mark.parametrize("case", ["attention->AttnProcessor", "attention->subclass"])
@torch.no_grad()
def test_processor_set_after_apply_runs_stock(case, q_chunks):
    module, args, kwargs, processor = _processor_swaps()[case]
    ref = module(*args, **kwargs)
    handle = streamplan.apply(module, chunk_tokens=16)
    assert list(handle.installed) == [""]
    _assert_close(module(*args, **kwargs), ref)  # streamed while the processor is the known one
    assert q_chunks
    q_chunks.clear()
    module.set_processor(processor)
    out = module(*args, **kwargs)
    assert q_chunks == []
    text = handle.report()
    assert "ran stock" in text and type(processor).__name__ in text, text
    handle.remove()
    _assert_equal(out, module(*args, **kwargs))  # exactly the module's own forward with that processor


@torch.no_grad()
def test_a_captured_block_is_captured_again_when_its_processor_changes(q_chunks):
    wan = _wan()
    x, rotary = torch.randn(2, 50, DIM), _wan_rotary(50)
    handle = streamplan.apply(wan, chunk_tokens=16)
    wan(x, rotary_emb=rotary)                   # captured with WanAttnProcessor
    wan.set_processor(_DoubledWanProcessor())
    q_chunks.clear()
    out = wan(x, rotary_emb=rotary)
    assert q_chunks, handle.report()            # streamed, from a capture of the new processor
    handle.remove()
    _assert_close(out, wan(x, rotary_emb=rotary))


@torch.no_grad()
def test_non_sequence_input_runs_stock():
    attn = _attention()
    x = torch.randn(2, DIM, 6, 9)  # [B, C, H, W]: AttnProcessor2_0 flattens it itself
    ref = attn(x)
    handle = streamplan.apply(attn, chunk_tokens=8)
    assert torch.equal(attn(x), ref)
    assert "ran stock: hidden_states is not [batch, tokens, dim]" in handle.report()


def test_autograd_recording_runs_stock():
    flux = _flux_double()
    x, enc = torch.randn(1, 40, DIM, requires_grad=True), torch.randn(1, 6, DIM)
    ref = flux(x, enc)
    handle = streamplan.apply(flux, chunk_tokens=8)
    out = flux(x, enc)
    _assert_equal(out, ref)
    (out[0].sum() + out[1].sum()).backward()
    assert x.grad is not None
    assert "autograd is recording: ran stock" in handle.report()


# ---------------------------------------------------------------------------------------------------------
# 5. the diffusers attention backend selects the consumer
# ---------------------------------------------------------------------------------------------------------
OTHER_BACKEND = "_native_math"
needs_other_backend = pytest.mark.skipif(OTHER_BACKEND not in {b.value for b in AttentionBackendName},
                                         reason=f"diffusers has no {OTHER_BACKEND} attention backend")


def _backend_cases():
    x = torch.randn(2, 60, DIM)
    return {
        "wan-self": (_wan(), (x,), dict(rotary_emb=_wan_rotary(60))),
        "flux-double": (_flux_double(), (x, torch.randn(2, 9, DIM)), dict(image_rotary_emb=_flux_rotary(69))),
        "flux-single-fused": (_fused(_flux_single()), (x,), dict(image_rotary_emb=_flux_rotary(60))),
    }


@needs_other_backend
@pytest.mark.parametrize("case", ["wan-self", "flux-double", "flux-single-fused"])
@torch.no_grad()
def test_backend_without_consumer_runs_stock(case, q_chunks):
    module, args, kwargs = _backend_cases()[case]
    with attention_backend(OTHER_BACKEND):
        ref = module(*args, **kwargs)
    native = module(*args, **kwargs)
    handle = streamplan.apply(module, chunk_tokens=16)
    assert list(handle.installed) == [""]
    with attention_backend(OTHER_BACKEND):
        out = module(*args, **kwargs)
    assert q_chunks == [] and handle.plans[""] == []
    _assert_equal(out, ref)
    assert f"ran stock: attention backend '{OTHER_BACKEND}' has no streamplan consumer" in handle.report()
    # back on the native backend the same handle streams again
    _assert_close(module(*args, **kwargs), native)
    assert q_chunks and handle.plans[""][0].tier == "L1"
    # a backend set on the module's processor is honoured too
    q_chunks.clear()
    module.set_attention_backend(OTHER_BACKEND)
    _assert_equal(module(*args, **kwargs), ref)
    assert q_chunks == []


@needs_other_backend
@torch.no_grad()
def test_apply_under_a_backend_without_consumer_decides_per_call(q_chunks):
    """The backend is read at each call of a captured block: stock while it has no consumer, streamed after."""
    wan, flux, attn = _wan(), _flux_single(), _attention()
    model = torch.nn.ModuleList([wan, flux, attn])
    x = torch.randn(1, 40, DIM)
    args = {0: (x,), 1: (x,), 2: (x,)}
    kwargs = {0: dict(rotary_emb=_wan_rotary(40)), 1: dict(image_rotary_emb=_flux_rotary(40)), 2: {}}
    with attention_backend(OTHER_BACKEND):
        refs = [m(*args[i], **kwargs[i]) for i, m in enumerate(model)]
        handle = streamplan.apply(model, chunk_tokens=8)
        outs = [m(*args[i], **kwargs[i]) for i, m in enumerate(model)]
    assert set(handle.installed) == {"0", "1", "2"}
    for out, ref in zip(outs[:2], refs[:2]):
        _assert_equal(out, ref)
    # AttnProcessor2_0 calls F.scaled_dot_product_attention itself: diffusers' backend never applies to it
    _assert_close(outs[2], refs[2])
    assert q_chunks == [8] * 5, q_chunks
    assert handle.report().count(f"ran stock: attention backend '{OTHER_BACKEND}' has no streamplan consumer") == 2


@needs_other_backend
@torch.no_grad()
def test_attention_processor2_0_streams_under_any_backend(q_chunks):
    attn = _attention(qk_norm="layer_norm")
    x = torch.randn(2, 60, DIM)
    with attention_backend(OTHER_BACKEND):
        ref = attn(x)
        handle = streamplan.apply(attn, chunk_tokens=16)
        out = attn(x)
    _assert_close(out, ref)
    assert q_chunks == [16, 16, 16, 12] and handle.installed[""].runtime_notes == []


# ---------------------------------------------------------------------------------------------------------
# 6. memory (CPU, profiler) and the planner's prediction
# ---------------------------------------------------------------------------------------------------------
MiB = 2**20


@torch.no_grad()
def test_streamed_self_attention_memory():
    """8192 tokens, width 512, fp32: every [N, 512] tensor is 16 MiB.

    Stock holds q, k, v, the attention output and its reshaped copy (80 MiB). Streamed attention keeps the
    global K and V plus the module output (the design's floor, 48 MiB = 60% of stock) and one chunk's transients:
    a bound of 50% of stock is out of reach for self-attention by design, so the test checks the floor instead.
    """
    attn = Attention(512, heads=8, dim_head=64).eval()
    x = torch.randn(1, 8192, 512)
    ref, stock = streamplan.measure_peak(attn, x)
    assert stock >= 5 * 16 * MiB
    handle = streamplan.apply(attn, chunk_tokens=1024)
    out, streamed = streamplan.measure_peak(attn, x)
    assert rel_err(out, ref) <= 1e-5
    floor, chunk_tensor = 3 * 16 * MiB, 1024 * 512 * 4
    assert streamed <= floor + 4 * chunk_tensor
    assert streamed <= 0.70 * stock
    (plan,) = handle.plans[""]
    assert plan.tier == "L1" and abs(plan.predicted_peak - streamed) <= 0.15 * streamed


@torch.no_grad()
def test_streamed_cross_attention_memory_is_below_half_of_stock():
    """With a short text K/V (77 tokens) the floor is the output alone: streamed peaks under 50% of stock."""
    attn = Attention(512, cross_attention_dim=512, heads=8, dim_head=64).eval()
    x, enc = torch.randn(1, 8192, 512), torch.randn(1, 77, 512)
    ref, stock = streamplan.measure_peak(attn, x, enc)
    handle = streamplan.apply(attn, chunk_tokens=1024)
    out, streamed = streamplan.measure_peak(attn, x, enc)
    assert rel_err(out, ref) <= 1e-5
    assert streamed <= 0.50 * stock
    (plan,) = handle.plans[""]
    assert plan.tier == "L1" and abs(plan.predicted_peak - streamed) <= 0.15 * streamed


def _peak_cases():
    N, d, D = 2048, 256, 64
    x = torch.randn(1, N, d)

    def wan(**kw):
        return WanAttention(d, heads=4, dim_head=D, processor=WanAttnProcessor(), **kw).eval()

    double = FluxAttention(d, heads=4, dim_head=D, added_kv_proj_dim=d, context_pre_only=False, bias=True,
                           processor=FluxAttnProcessor()).eval()
    single = FluxAttention(d, heads=4, dim_head=D, out_dim=d, bias=True, pre_only=True,
                           processor=FluxAttnProcessor()).eval()
    return {
        "attention-self": (Attention(d, heads=4, dim_head=D, qk_norm="rms_norm").eval(), (x,), {}),
        "attention-cross": (Attention(d, heads=4, dim_head=D).eval(), (x, torch.randn(1, 77, d)), {}),
        "attention-padding-mask": (Attention(d, heads=4, dim_head=D).eval(), (x, None, _padding_mask(1, N)), {}),
        "attention-per-query-mask": (Attention(d, heads=4, dim_head=D).eval(), (x, None, _additive_mask(1, N, N)),
                                     {}),
        "wan-self-fused-rotary": (_fused(wan()), (x,), dict(rotary_emb=(torch.randn(1, N, 1, D),
                                                                       torch.randn(1, N, 1, D)))),
        "wan-cross": (wan(is_cross_attention=True), (x, torch.randn(1, 77, d)), {}),
        "flux-double": (double, (x, torch.randn(1, 256, d)), dict(image_rotary_emb=(torch.randn(N + 256, D),
                                                                                     torch.randn(N + 256, D)))),
        "flux-single": (single, (x,), dict(image_rotary_emb=(torch.randn(N, D), torch.randn(N, D)))),
    }


@pytest.mark.parametrize("case", ["attention-self", "attention-cross", "attention-padding-mask",
                                  "attention-per-query-mask",
                                  "wan-self-fused-rotary",
                                  "wan-cross", "flux-double", "flux-single"])
@torch.no_grad()
def test_predicted_peak_matches_the_meter(case):
    module, args, kwargs = _peak_cases()[case]
    ref, stock = streamplan.measure_peak(lambda: module(*args, **kwargs))
    handle = streamplan.apply(module, chunk_tokens=256)
    out, streamed = streamplan.measure_peak(lambda: module(*args, **kwargs))
    _assert_close(out, ref)
    (plan,) = handle.plans[""]
    assert plan.tier == "L1" and streamed < stock
    assert abs(plan.predicted_peak - streamed) <= 0.15 * streamed, (plan.predicted_peak / MiB, streamed / MiB)
