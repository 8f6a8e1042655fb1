"""What a new user hit (issue 9): state kept by the caller, training mode, a second apply, what stays stock, NaNs,
and the arguments' errors. Each test failed before its fix."""
import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import streamplan
from streamplan.verify import compare_outputs


def _causal_lm(vocab=100, **kw):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=vocab, attn_implementation="sdpa", **kw)
    return LlamaForCausalLM(cfg).eval()


def _cache_rows(cache) -> list[int]:
    return [layer.keys.shape[-2] for layer in cache.layers]


@torch.no_grad()
def test_self_check_leaves_the_generate_cache_as_a_streamed_call_does():
    model = _causal_lm()
    ids = torch.randint(0, 100, (1, 700))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    handle = streamplan.apply(model, chunk_tokens=128, self_check=True)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert _cache_rows(out.past_key_values) == _cache_rows(ref.past_key_values) == [703, 703]
    assert torch.equal(out.sequences, ref.sequences)
    notes = [n for e in handle.installed.values() for n in e.runtime_notes]
    assert any("self-check" in n for n in notes), handle.report()
    # the checked call is the streamed one: the prefill of layer 0 was planned and streamed, not turned away by a
    # cache the reference run had filled
    assert any(p.tier == "L1" and p.rows == 700 for p in handle.plans["model.layers.0"]), handle.report()
    handle.remove()


@torch.no_grad()
def test_self_check_and_verify_leave_an_explicit_cache_untouched():
    model = _causal_lm()
    ids = torch.randint(0, 100, (1, 300))
    ref_cache = DynamicCache(config=model.config)
    ref = model(ids, past_key_values=ref_cache, use_cache=True).logits
    handle = streamplan.apply(model, chunk_tokens=64, self_check=True)
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True).logits
    assert _cache_rows(cache) == [300, 300]
    for a, b in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    handle.remove()
    untouched = DynamicCache(config=model.config)
    diffs = streamplan.verify(model, ids, past_key_values=untouched, use_cache=True)
    assert untouched.get_seq_length() == 0 and max(d["rel"] for d in diffs.values()) < 1e-5


@torch.no_grad()
def test_self_check_logs_once_and_the_report_says_what_the_checks_took(caplog):
    """self_check on a whole model (blocks inside a model forward): its line logged once, named, and its note says
    the extra memory the check took; verify on a streamed model puts its own extra memory in the report."""
    model = _causal_lm()
    ids = torch.randint(0, 100, (1, 300))
    handle = streamplan.apply(model, chunk_tokens=64, self_check=True)
    try:
        with caplog.at_level("INFO", logger="streamplan"):
            model(ids)
            model(ids)
        logged = [r.getMessage() for r in caplog.records if "self-check against stock" in r.getMessage()]
        assert len(logged) == 1 and logged[0].startswith("streamplan: model.layers.0: "), logged
        assert "its extra memory" in logged[0] and "stock's peak" in logged[0] and "stock's output" in logged[0]
        text = handle.report()
        assert text.count("self-check against stock") == 1 and "check: verify" not in text
        streamplan.verify(model, ids)
        text = handle.report()
        assert "check: verify ran stock after the streamed call: its extra memory is stock's peak" in text
        assert "a copy of the inputs" in text and "the streamed outputs" in text
    finally:
        handle.remove()


def test_verify_leaves_donated_inputs_as_they_were():
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    block = WanTransformerBlock(64, 128, 4, cross_attn_norm=True).eval()
    freqs = torch.randn(1, 90, 1, 16)
    args = (torch.randn(1, 90, 64), torch.randn(1, 7, 64), torch.randn(1, 6, 64), (freqs.cos(), freqs.sin()))
    before = [a.clone() for a in args[:3]]
    streamplan.verify(block, *args)
    assert all(torch.equal(a, b) for a, b in zip(args[:3], before))


def test_train_after_apply_runs_stock_and_says_so():
    torch.manual_seed(0)
    model = _causal_lm(attention_dropout=0.5)
    ids = torch.randint(0, 100, (1, 200))
    handle = streamplan.apply(model, chunk_tokens=64)
    model.train()
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b)                              # dropout is live: the stock training forward ran
    assert "in training mode: ran stock" in handle.report()
    assert not any(p.tier != "L0" for ps in handle.plans.values() for p in ps)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
    assert any(p.tier == "L1" for ps in handle.plans.values() for p in ps)
    handle.remove()


def test_apply_to_a_part_of_a_streamed_model_names_the_handle():
    model = _causal_lm()
    handle = streamplan.apply(model, chunk_tokens=64)
    with pytest.raises(ValueError, match="already streams.*remove"):
        streamplan.apply(model.model.layers[0], chunk_tokens=32)
    again = streamplan.apply(model, chunk_tokens=32)            # the whole model again: re-planned
    ids = torch.randint(0, 100, (1, 100))
    with torch.no_grad():
        model(ids)
    assert {p.chunk for p in again.plans["model.layers.0"]} == {32} and handle.superseded_by is again
    handle.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


@torch.no_grad()
def test_stock_output_heads_are_reported_and_held_to_a_byte_budget():
    model = _causal_lm(vocab=32000)
    ids = torch.randint(0, 32000, (1, 2048))
    logits = 2048 * 32000 * 4
    handle = streamplan.apply(model, budget="8MiB")
    with pytest.raises(streamplan.BudgetError, match=r"lm_head \(Linear\) runs stock.*logits_to_keep"):
        model(ids)
    handle.remove()
    handle = streamplan.apply(model, budget="1GiB")
    model(ids)
    assert "lm_head  (Linear)" in handle.report() and "250.00 MiB" in handle.report()
    import json
    stock = {s["name"]: s for s in json.loads(handle.to_json())["stock"]}
    assert stock["lm_head"]["output_bytes"] == logits
    assert handle.predicted_peak() >= logits
    handle.remove()
    handle = streamplan.apply(model, budget="8MiB")            # fewer logits: it fits
    model(ids, logits_to_keep=1)
    assert "lm_head" not in handle.report()
    handle.remove()


def test_model_level_plans_are_filled_and_labels_whole():
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                  rope_max_seq_len=32).eval()
    handle = streamplan.apply(model, chunk_tokens=64)
    with torch.no_grad():
        model(torch.randn(1, 4, 4, 16, 16), timestep=torch.tensor([3]), encoder_hidden_states=torch.randn(1, 8, 32))
    import json
    (plan,) = json.loads(handle.to_json())["streamed"][""]["plans"]
    assert plan["rows"] == 4 * 8 * 8 and plan["predicted_peak"] > 0 and plan["stock_peak"] > plan["predicted_peak"]
    assert handle.installed[""].spec.label in handle.report()
    handle.remove()


def test_compare_outputs_is_nan_aware():
    ref = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    assert compare_outputs(ref.clone(), ref)["output"] == {"max_abs": 0.0, "rel": 0.0, "nan_mismatch": 0}
    other = torch.tensor([1.0, 2.0, 3.5, float("inf")])
    d = compare_outputs(other, ref)["output"]
    assert d["nan_mismatch"] == 1 and d["max_abs"] == 0.5 and math.isinf(d["rel"])


@pytest.mark.parametrize("kwargs, words", [
    ({"budget": float("nan")}, "budget must be a finite"),
    ({"budget": float("inf")}, "budget must be a finite"),
    ({"budget": 0.5}, "budget must be at least 1 byte"),
    ({"budget": "-5GiB"}, "budget must be at least 1 byte"),
    ({"reserve": -1}, "reserve must be 0 or more"),
    ({"reserve": "lots"}, "reserve 'lots' cannot be parsed"),
    ({"head_groups": 0}, "head_groups must be a positive int (groups the K/V heads"),
    ({"ffn_slice": -1}, "ffn_slice must be a positive int (MLP hidden features"),
    ({"chunk_tokens": 1.5}, "chunk_tokens must be a positive int (rows per chunk"),
])
def test_bad_arguments_name_themselves(kwargs, words):
    with pytest.raises(ValueError) as exc:
        streamplan.apply(torch.nn.Linear(2, 2), **kwargs)
    assert words in str(exc.value)


def test_size_strings_take_exponents():
    assert streamplan.parse_budget("1e9") == 10**9 and streamplan.parse_budget("1.5e3 MiB") == 1500 * 2**20
