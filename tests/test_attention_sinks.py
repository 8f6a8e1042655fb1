"""Attention sinks (GPT-OSS: a logit per head joined to every row's scores, with no value): the hand-written chain
found in the graph with its sinks, each Q chunk attended over the real keys and merged with the sinks by log-sum-exp.
Against transformers' own GPT-OSS, fp32 on CPU: its sliding-window and full-attention layers, a whole prefill."""
import pytest
import torch

pytest.importorskip("transformers")

import streamplan  # noqa: E402
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable  # noqa: E402



def _model(layers=("sliding_attention", "full_attention")):
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=len(layers),
                       vocab_size=128, sliding_window=64, layer_types=list(layers), attn_implementation="eager")
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    for p in model.parameters():   # sinks and experts away from their zero initialisation
        torch.nn.init.normal_(p, std=0.1)
    return model


@torch.no_grad()
def test_the_sinks_are_found_with_the_attention_and_change_its_output():
    from streamplan.tools.catalogue.transformers_cases import CASES
    case = CASES["gpt_oss"]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(256, torch.device("cpu"), torch.float32)
    found, _ = streamable(layer, args, kwargs, 256)
    att = found.analysis.attentions[0]
    assert att.sinks is not None and att.sinks.meta["val"].shape == (layer.self_attn.sinks.shape[0],)
    ref = layer(*args, **kwargs)
    layer.self_attn.sinks.data.fill_(-1e4)   # sinks that take nothing: a different output, so they are applied
    assert rel_err(layer(*args, **kwargs)[0] if isinstance(ref, tuple) else layer(*args, **kwargs),
                ref[0] if isinstance(ref, tuple) else ref) > 1e-4


@torch.no_grad()
def test_a_gpt_oss_prefill_streams_its_layers_exactly():
    model = _model()
    ids = torch.randint(0, 128, (1, 300))
    ref, stock_peak = streamplan.measure_peak(lambda: model(ids, use_cache=False).logits)
    with streamed(model, chunk_tokens=64) as handle:
        model(ids, use_cache=False)   # the captures, outside the measurement
        out, peak = streamplan.measure_peak(lambda: model(ids, use_cache=False).logits)
        for i in (0, 1):
            plans = handle.plans.get(f"model.layers.{i}") or []
            assert plans and all(p.tier == "L1" for p in plans), handle.report()
        assert rel_err(out, ref) <= 1e-5
        assert peak < stock_peak, (peak, stock_peak)



@torch.no_grad()
def test_a_gpt_oss_layer_under_a_byte_budget_holds_it():
    """The sinks path attends by the math path (fp32 scores of the chunk's rows, several at once): priced so, an
    accepted budget is held (it was accepted at 105.6 MiB and measured 193 before)."""
    from streamplan.tools.catalogue.transformers_cases import CASES
    case = CASES["gpt_oss"]
    torch.manual_seed(0)
    layer = case.build()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    args, kwargs = case.inputs(2048, torch.device("cpu"), torch.float32)
    ref, stock = streamplan.measure_peak(lambda: layer(*args, **kwargs))
    live = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor))
    budget = live + stock // 2
    with streamed(layer, budget=budget) as handle:
        out, peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
        (plan,) = handle.plans[""]
        assert plan.tier != "L0", handle.report()
        assert live + peak <= budget, (live + peak, budget, handle.report())
        assert rel_err(out[0] if isinstance(out, tuple) else out, ref[0] if isinstance(ref, tuple) else ref) <= 1e-5
