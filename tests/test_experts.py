"""Mixture-of-experts feed-forwards taken whole as one row-local op on each chunk's rows (``integrations.experts``,
``graph.opaque_layers``): transformers' own MoE decoder layers and whole tiny causal LMs against their own forward,
the memory model's charge for the routed rows against the meter, and the routers that must stay stock, named."""
import pytest
import torch

pytest.importorskip("transformers")

import streamplan  # noqa: E402
from streamplan.integrations.experts import is_experts, refusal, workspace  # noqa: E402
from streamplan.specs import GraphSpec  # noqa: E402
from streamplan.tools.catalogue.transformers_cases import CASES  # noqa: E402

MOE_LAYERS = ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "phimoe", "qwen3_next", "minimax", "dbrx"]
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=128, max_position_embeddings=8192, head_dim=16)


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _experts_module(layer):
    return next((n, m) for n, m in layer.named_modules() if is_experts(m))


@pytest.mark.parametrize("name", MOE_LAYERS)
@torch.no_grad()
def test_an_moe_layer_streams_with_its_experts_run_whole_on_each_chunk(name):
    case = CASES[name]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(300, torch.device("cpu"), torch.float32)
    ref, ref_peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
    handle = streamplan.apply(layer, chunk_tokens=64)
    try:
        out, peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
        entry = handle.installed[""]
        assert isinstance(entry.spec, GraphSpec) and all(p.tier == "L1" for p in entry.plans.values()), \
            handle.report()
        assert "run whole on each chunk's rows as opaque ops (mixture of experts" in handle.report()
        o, r = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)
        assert _rel(o, r) <= 1e-5
        assert peak < 0.6 * ref_peak, (peak, ref_peak)
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "dbrx"])
@torch.no_grad()
def test_the_charge_for_an_experts_call_bounds_what_it_allocates(name):
    """The memory model charges an experts call per row as if every token of the chunk went to one expert (routing
    is data-dependent): the meter's figure for a call stays within it, worst routing included (every token's router
    logits made to pick the same experts), and the charge is not far above that worst."""
    torch.manual_seed(0)
    layer = CASES[name].build()
    _, moe = _experts_module(layer)
    rows = 256
    x = torch.randn(1, rows, 64)
    _, per_row = workspace(moe, x)
    out, peak = streamplan.measure_peak(lambda: moe(x))
    assert peak - out.numel() * 4 <= per_row * rows, (peak - out.numel() * 4, per_row * rows)
    router = getattr(moe, "gate", None) or moe.router
    lin = router if isinstance(getattr(router, "weight", None), torch.Tensor) else \
        next(m for m in router.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    lin.weight.zero_()
    lin.weight[0] = 1.0                       # expert 0 first for every token (then the rest, tied)
    x = torch.rand(1, rows, 64) + 0.5         # positive rows: expert 0's logit the largest
    out, worst = streamplan.measure_peak(lambda: moe(x))
    assert worst - out.numel() * 4 <= per_row * rows, (worst - out.numel() * 4, per_row * rows)
    assert per_row * rows <= 3 * (worst - out.numel() * 4), (worst, per_row * rows)


@pytest.mark.parametrize("family, extra", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)),
])
@torch.no_grad()
def test_a_whole_moe_prefill_streams_exact_at_a_fraction_of_stocks_peak(family, extra):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, **TINY, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 128, (1, 1000))
    ref, ref_peak = streamplan.measure_peak(lambda: model(ids, use_cache=False).logits)
    handle = streamplan.apply(model, chunk_tokens=128)
    try:
        out, peak = streamplan.measure_peak(lambda: model(ids, use_cache=False).logits)
        streamed = [n for n, e in handle.installed.items() if isinstance(e.spec, GraphSpec)
                    and any(p.tier == "L1" for p in e.plans.values())]
        assert len(streamed) == 2, handle.report()
        assert _rel(out, ref) <= 1e-5
        assert peak <= 0.6 * ref_peak, (peak, ref_peak)
    finally:
        handle.remove()
    assert torch.equal(model(ids, use_cache=False).logits, ref)


@torch.no_grad()
def test_a_budget_plans_an_moe_layer_within_it():
    case = CASES["qwen3_moe"]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(4096, torch.device("cpu"), torch.float32)
    ref, ref_peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
    inputs = sum(t.numel() * t.element_size() for t in [args[0], *kwargs["position_embeddings"]])
    budget = inputs + (ref_peak - inputs) // 2
    handle = streamplan.apply(layer, budget=budget)
    try:
        out, peak = streamplan.measure_peak(lambda: layer(*args, **kwargs))
        plans = list(handle.installed[""].plans.values())
        assert plans and plans[0].tier != "L0", handle.report()
        assert peak <= budget, (peak, budget, handle.report())
        assert _rel(out, ref) <= 1e-5
    finally:
        handle.remove()


@torch.no_grad()
def test_a_router_that_drops_tokens_over_capacity_keeps_its_block_stock_named():
    """Switch Transformers' router keeps at most ``expert_capacity`` tokens per expert, chosen over the whole call:
    a chunk would keep others. Its feed-forward layer stays stock with that reason, and its output is stock's."""
    from transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers import modeling_switch_transformers as st
    cfg = SwitchTransformersConfig(d_model=64, d_ff=128, num_heads=4, d_kv=16, num_experts=4, expert_capacity=8,
                                   num_layers=2, num_decoder_layers=2, vocab_size=128)
    torch.manual_seed(0)
    block = st.SwitchTransformersBlock(cfg, has_relative_attention_bias=True, is_sparse=True).eval()
    x = torch.randn(1, 300, 64)
    ref = block(x)
    handle = streamplan.apply(block, chunk_tokens=64, capture="prefer")
    try:
        out = block(x)
        report = handle.report()
        assert "a router that drops tokens over an expert's capacity (expert_capacity=8)" in report, report
        assert not any(p.tier != "L0" for p in handle.installed["layer.1"].plans.values()), report
        assert torch.equal(out[0], ref[0])
    finally:
        handle.remove()
    assert refusal(block.layer[1].mlp) is not None and refusal(_experts_module(CASES["mixtral"].build())[1]) is None


class _AttentionThenGptOssMLP(torch.nn.Module):
    """Self-attention, then GPT-OSS's own experts feed-forward, returning its router scores beside the rows as the
    real ``GptOssMLP`` does (GPT-OSS's decoder layer itself stays stock for its attention sinks)."""

    def __init__(self, mlp):
        super().__init__()
        self.qkv, self.out, self.mlp = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64), mlp

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        y, scores = self.mlp(x)
        return x + y, scores


@torch.no_grad()
def test_experts_that_return_router_scores_beside_their_rows_stream_both():
    """GPT-OSS's ``GptOssMLP`` returns (rows, router scores per token): learnt by running it on three tokens before
    the capture, the op gives both, each chunk's rows of them, equal to the module's own."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1)
    torch.manual_seed(0)
    mlp = GptOssMLP(cfg).eval()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    block = _AttentionThenGptOssMLP(mlp).eval()
    x = torch.randn(1, 300, 64)
    ref = block(x)
    handle = streamplan.apply(block, chunk_tokens=64)
    try:
        out = block(x)
        assert handle.plans[""][0].tier == "L1", handle.report()
        assert "mixture of experts: GptOssMLP mlp" in handle.report(), handle.report()
        assert out[1].shape == ref[1].shape == (300, 2)
        assert _rel(out[0], ref[0]) <= 1e-5 and _rel(out[1], ref[1]) <= 1e-5
    finally:
        handle.remove()
