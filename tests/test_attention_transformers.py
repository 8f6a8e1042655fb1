"""Streamed Llama-family attention against transformers' own modules: sdpa and eager, GQA, causal, padding, cache."""
import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaModel, MistralConfig, MistralModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import streamplan
from conftest import RecordingConsumer, rel_err


def _llama(impl: str, heads=4, kv_heads=2, layers=2, cls=(LlamaConfig, LlamaModel), **kw):
    cfg_cls, model_cls = cls
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  num_hidden_layers=layers, vocab_size=100, attn_implementation=impl, **kw)
    return model_cls(cfg).eval()


class AttentionHandles:
    """streamplan applied to each layer's attention alone (the decoder layers themselves stay stock)."""

    def __init__(self, model, **kw):
        self.handles = [streamplan.apply(layer.self_attn, **kw) for layer in model.layers]

    @property
    def installed(self):
        return {f"layers.{i}.self_attn": e for i, h in enumerate(self.handles) for e in h.installed.values()}

    def report(self):
        return "\n".join(h.report() for h in self.handles)

    def remove(self):
        for h in self.handles:
            h.remove()


def _attn_entries(handle):
    return {n: e for n, e in handle.installed.items() if n.endswith("self_attn")}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("batch, tokens, chunk", [(1, 70, 16), (3, 33, 64), (2, 100, 7)])
@torch.no_grad()
def test_causal_prefill_matches(impl, heads, kv_heads, batch, tokens, chunk):
    model = _llama(impl, heads, kv_heads)
    ids = torch.randint(0, 100, (batch, tokens))
    ref = model(ids).last_hidden_state
    handle = AttentionHandles(model, chunk_tokens=chunk)
    assert len(_attn_entries(handle)) == 2, handle.report()
    out = model(ids).last_hidden_state
    assert rel_err(out, ref) <= 1e-5
    for e in _attn_entries(handle).values():
        assert not e.runtime_notes, e.runtime_notes
        (plan,) = e.plans.values()
        assert plan.tier == ("L1" if tokens > chunk else "L0")
    handle.remove()
    assert torch.equal(model(ids).last_hidden_state, ref)


@torch.no_grad()
def test_a_causal_chunk_with_grouped_heads_stays_within_the_declared_workspace():
    """A causal Q chunk after the first through the SDPA consumer, as a streamed Llama-3 layer calls it (32 query heads
    on 8 K/V heads of 128, q laid out [B, rows, heads, D] underneath): exact against PyTorch's SDPA over the chunk's
    keys, and its measured peak beyond its output within the workspace the consumer declares to the planner (the
    diagonal block's K/V heads, repeated for the query heads, are let go before the past keys' call)."""
    n, c, heads, kv_heads, d = 1024, 128, 32, 8, 128
    k, v = (torch.randn(1, n, kv_heads, d).transpose(1, 2) for _ in range(2))
    q = torch.randn(1, c, heads, d).transpose(1, 2)
    sdpa = streamplan.attention.SDPA
    out, peak = streamplan.measure_peak(lambda: sdpa.attend(q, k, v, q_offset=n - c, causal=True, mask=None,
                                                            scale=None))
    rep = heads // kv_heads
    seen = torch.ones(c, n, dtype=torch.bool).tril(n - c)   # row i of the chunk sees keys 0 .. n - c + i
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                           attn_mask=seen)
    assert rel_err(out, ref) <= 1e-5
    declared = sdpa.workspace_row_bytes(heads=heads, head_dim=d, elem=4, causal=True, masked=False)
    assert peak - out.numel() * 4 <= declared * c, (peak / c - heads * d * 4, declared)


@pytest.mark.parametrize("heads, kv_heads, causal", [(8, 2, True), (4, 4, True), (8, 2, False)],
                         ids=["gqa-causal", "mha-causal", "gqa-full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_the_consumer_declares_what_a_chunk_allocates(heads, kv_heads, causal, dtype):
    """Every chunk of a streamed attention through the SDPA consumer (the first causal one, later ones split into past
    keys and diagonal block, a non-causal one): its measured peak beyond its output is within the whole-call workspace
    the consumer declares to the captured path's planner, and the declaration is tight for the worst chunk where the
    kernels' allocations are known (fp32; 16-bit where oneDNN runs the matmuls) (the CPU
    flash kernel's per-thread tiles do not scale with the rows: a per-row figure cannot say them)."""
    n, c, d = 1200, 400, 32
    k, v = (torch.randn(1, n, kv_heads, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    sdpa = streamplan.attention.SDPA
    elem = k.element_size()
    declared = sdpa.workspace_bytes(rows=c, keys=n, heads=heads, kv_heads=kv_heads, head_dim=d, elem=elem,
                                    causal=causal, masked=False, device_type="cpu")
    worst = 0
    for a in range(0, n, c):
        q = torch.randn(1, c, heads, d, dtype=dtype).transpose(1, 2)
        out, peak = streamplan.measure_peak(lambda: sdpa.attend(q, k, v, q_offset=a, causal=causal, mask=None,
                                                                scale=None))
        worst = max(worst, peak - out.numel() * elem)
    assert worst <= declared, (worst, declared)
    if dtype == torch.float32 or streamplan.attention.sdpa.onednn_16bit_gemm():   # else a bound, not a fit
        assert 0.9 * declared <= worst, (worst, declared)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.no_grad()
def test_padded_batch_with_attention_mask(impl):
    model = _llama(impl)
    ids = torch.randint(0, 100, (3, 61))
    mask = torch.ones(3, 61, dtype=torch.long)
    mask[1, :9] = 0      # left padding
    mask[2, 50:] = 0     # right padding
    ref = model(ids, attention_mask=mask).last_hidden_state
    handle = AttentionHandles(model, chunk_tokens=16)
    out = model(ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    assert rel_err(out[keep], ref[keep]) <= 1e-5
    assert all(not e.runtime_notes and e.plans for e in _attn_entries(handle).values())


@torch.no_grad()
def test_prefill_fills_the_cache_like_stock():
    model = _llama("sdpa")
    ids = torch.randint(0, 100, (2, 50))
    ref = model(ids, use_cache=True)
    handle = AttentionHandles(model, chunk_tokens=16)
    out = model(ids, use_cache=True)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state) <= 1e-5
    for layer in range(2):
        k_ref, v_ref = ref.past_key_values.layers[layer].keys, ref.past_key_values.layers[layer].values
        k, v = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
        assert rel_err(k, k_ref) <= 1e-5 and rel_err(v, v_ref) <= 1e-5
    # decoding one more token against the streamed cache: the cache now holds tokens, so this call runs stock
    nxt = torch.randint(0, 100, (2, 1))
    step = model(nxt, past_key_values=out.past_key_values, use_cache=True).last_hidden_state
    step_ref = model.__class__.forward(model, nxt, past_key_values=ref.past_key_values, use_cache=True)
    assert rel_err(step, step_ref.last_hidden_state) <= 1e-5
    assert any("cache that already holds tokens" in n for e in _attn_entries(handle).values() for n in e.runtime_notes)


@torch.no_grad()
def test_mistral_attention_with_its_own_forward_stays_stock_and_says_why():
    # MistralAttention's forward passes sliding_window to the backend: not the Llama forward, so not streamed
    model = _llama("sdpa", cls=(MistralConfig, MistralModel), sliding_window=None)
    ids = torch.randint(0, 100, (2, 40))
    ref = model(ids).last_hidden_state
    handle = streamplan.apply(model, chunk_tokens=16)
    assert {"layers.0.mlp", "layers.1.mlp"} <= set(handle.installed)  # the MLPs (and norms) still stream
    assert not any(n.endswith("self_attn") for n in handle.installed)
    assert "not the Llama-family forward" in handle.report()
    assert rel_err(model(ids).last_hidden_state, ref) <= 1e-5


def test_training_mode_and_attention_dropout_stay_stock():
    model = _llama("sdpa", attention_dropout=0.1).train()
    handle = AttentionHandles(model)
    assert not _attn_entries(handle)
    assert "training mode" in handle.report()


@pytest.fixture
def custom_attention():
    AttentionInterface.register("my_attention", sdpa_attention_forward)
    yield "my_attention"
    streamplan.unregister_consumer("my_attention")


@torch.no_grad()
def test_a_registered_consumer_gets_bounded_q_with_offsets(custom_attention):
    consumer = RecordingConsumer()
    streamplan.register_consumer(custom_attention, consumer)
    model = _llama(custom_attention, layers=1)
    ids = torch.randint(0, 100, (2, 50))
    ref = model(ids).last_hidden_state
    handle = AttentionHandles(model, chunk_tokens=16)
    out = model(ids).last_hidden_state
    assert rel_err(out, ref) <= 1e-5
    assert [(rows, off) for rows, off, _, _ in consumer.calls] == [(16, 0), (16, 16), (16, 32), (2, 48)]
    assert all(keys == 50 and causal for _, _, keys, causal in consumer.calls)
    handle.remove()


@torch.no_grad()
def test_an_unregistered_override_stays_stock(custom_attention):
    model = _llama(custom_attention, layers=1)
    ids = torch.randint(0, 100, (2, 50))
    ref = model(ids).last_hidden_state
    handle = AttentionHandles(model, chunk_tokens=16)
    assert not _attn_entries(handle)
    assert "my_attention" in handle.report() and "no streamplan consumer" in handle.report()
    assert torch.equal(model(ids).last_hidden_state, ref)


@torch.no_grad()
def test_a_consumer_without_offsets_gets_the_stock_call(custom_attention):
    consumer = RecordingConsumer()
    consumer.caps = streamplan.ConsumerCaps(q_offset=False)
    streamplan.register_consumer(custom_attention, consumer)
    model = _llama(custom_attention, layers=1)
    ids = torch.randint(0, 100, (2, 50))
    ref = model(ids).last_hidden_state
    handle = AttentionHandles(model, chunk_tokens=16)
    assert torch.equal(model(ids).last_hidden_state, ref)
    assert consumer.calls == []
    assert "cannot offset a causal mask" in handle.report()
