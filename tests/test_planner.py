"""The planner: budgets in, tiers and chunks out, predicted and checked with the meter."""
import json

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import streamplan
import streamplan.plan.planner
from conftest import RecordingConsumer, rel_err

MiB = 2**20


def _tiers(handle) -> list[str]:
    """Every plan's tier, a model forward's included (it is L0 once every block in it fitted stock)."""
    return [p.tier for plans in handle.plans.values() for p in plans]


def _llama(layers=2, impl="sdpa"):
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=layers, vocab_size=100, attn_implementation=impl)
    return LlamaModel(cfg).eval()


@pytest.fixture(scope="module")
def llama_case():
    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(0, 100, (1, 4096))
    with torch.no_grad():
        ref, stock = streamplan.measure_peak(lambda: model(ids).last_hidden_state)
    return model, ids, ref, stock


@pytest.fixture(scope="module")
def wan_case():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4,
                                  out_channels=4, text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=2,
                                  rope_max_seq_len=1024).eval()
    args = (torch.randn(1, 4, 4, 64, 64), torch.tensor([500]), torch.randn(1, 32, 64))   # 4096 tokens
    with torch.no_grad():
        ref, stock = streamplan.measure_peak(lambda: model(*args).sample)
    return model, args, ref, stock


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.4])
@torch.no_grad()
def test_a_budget_between_floor_and_stock_is_kept_and_predicted(wan_case, fraction):
    """A whole diffusers Wan model (its forward streamed by streamplan, so everything it holds is seen by the
    plans). On CPU there is no allocator counter: memory a model's own forward keeps outside the streamed modules'
    arguments (transformers' LlamaModel keeps its input embeddings) is seen on CUDA only."""
    model, args, ref, stock = wan_case
    budget = int(stock * fraction)
    handle = streamplan.apply(model, budget=budget)
    try:
        out, peak = streamplan.measure_peak(lambda: model(*args).sample)
        assert rel_err(out, ref) <= 1e-5
        assert peak <= budget, (peak / MiB, budget / MiB)
        predicted = handle.predicted_peak()
        assert abs(predicted - peak) <= 0.10 * peak, (predicted / MiB, peak / MiB)
        tiers = {p.tier for plans in handle.plans.values() for p in plans}
        assert tiers & {"L1", "L2"}, handle.report()
    finally:
        handle.remove()


@torch.no_grad()
def test_a_budget_above_stock_keeps_every_block_stock(llama_case):
    model, ids, ref, stock = llama_case
    handle = streamplan.apply(model, budget=int(stock * 1.5))
    out = model(ids).last_hidden_state
    assert torch.equal(out, ref)
    assert set(_tiers(handle)) == {"L0"}, handle.report()
    handle.remove()


@torch.no_grad()
def test_a_budget_below_the_floor_raises_before_the_block_runs_and_changes_nothing(llama_case):
    model, ids, ref, stock = llama_case
    params = {n: p.clone() for n, p in model.named_parameters()}
    ids_before = ids.clone()
    handle = streamplan.apply(model, budget="8MiB")
    with pytest.raises(streamplan.BudgetError) as err:
        model(ids)
    text = str(err.value)
    assert "8.00 MiB" in text and "global K, V and the outputs" in text and "layers.0" in text, text
    handle.remove()
    assert torch.equal(ids, ids_before)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert torch.equal(model(ids).last_hidden_state, ref)


@torch.no_grad()
def test_plans_are_data_deterministic_and_serialisable(llama_case):
    model, ids, _, stock = llama_case
    dumps = []
    # a first apply in the process captures the layer (what the capture leaves alive is live then): compare after it
    for _ in range(3):
        handle = streamplan.apply(model, budget=int(stock * 0.6))
        model(ids)
        dumps.append(handle.to_json())
        plans = handle.plans
        handle.remove()
    assert dumps[1] == dumps[2]
    data = json.loads(dumps[1])
    block = data["streamed"]["layers.0"]["plans"][0]
    assert {"tier", "chunk", "predicted_peak", "stock_peak", "live_bytes"} <= set(block)
    assert isinstance(plans["layers.0"][0], streamplan.plan.planner.Plan)


@torch.no_grad()
def test_the_report_is_a_table_with_the_budget(llama_case):
    model, ids, _, stock = llama_case
    handle = streamplan.apply(model, budget=int(stock * 0.6))
    model(ids)
    text = handle.report()
    handle.remove()
    assert "budget:" in text and "tier" in text and "predicted" in text and "layers.1" in text


@torch.no_grad()
def test_auto_budget_on_cpu_plans_stock_when_memory_is_plentiful():
    model = _llama(layers=1)
    ids = torch.randint(0, 100, (1, 256))
    ref = model(ids).last_hidden_state
    handle = streamplan.apply(model, budget="auto", reserve="1GiB")
    assert torch.equal(model(ids).last_hidden_state, ref)
    assert set(_tiers(handle)) == {"L0"}, handle.report()
    assert "budget: auto" in handle.report()


@pytest.mark.parametrize("budget", ["12 GiBs", "-1", "lots", 0])
def test_bad_budgets_are_named(budget):
    with pytest.raises(ValueError, match="budget"):
        streamplan.apply(_llama(layers=1), budget=budget)


@torch.no_grad()
def test_out_of_memory_in_a_chunk_is_retried_in_halves_without_losing_or_repeating_work():
    AttentionInterface.register("flaky", sdpa_attention_forward)
    consumer = RecordingConsumer(max_rows=8)
    streamplan.register_consumer("flaky", consumer)
    try:
        model = _llama(layers=2, impl="flaky")
        ids = torch.randint(0, 100, (2, 50))
        ref = model(ids).last_hidden_state
        handle = streamplan.apply(model, chunk_tokens=32)
        out = model(ids).last_hidden_state
        assert rel_err(out, ref) <= 1e-5
        rows = [(off, n) for n, off, _, _ in consumer.calls]
        layer0 = sorted(rows[: len(rows) // 2])
        assert [a for a, _ in layer0] == sorted(set(a for a, _ in layer0))     # no row range attended twice
        assert sum(n for _, n in layer0) == 50                                   # and none left out
        assert "out of memory on rows [0:32): retried in halves" in handle.report()
    finally:
        streamplan.unregister_consumer("flaky")


def _wan_block_case(tokens=2048, dim=256):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.manual_seed(0)
    block = WanTransformerBlock(dim, 4 * dim, 8, cross_attn_norm=True).eval()
    freqs = torch.randn(1, tokens, 1, dim // 8)
    args = (torch.randn(1, tokens, dim), torch.randn(1, 32, dim), torch.randn(1, 6, dim), (freqs.cos(), freqs.sin()))
    return block, args


@pytest.mark.parametrize("mode", [dict(chunk_tokens=300, ffn_slice=96), dict(chunk_tokens=300, head_groups=2),
                                  dict(chunk_tokens=300, head_groups=8, ffn_slice=200)],
                         ids=["L2", "L3", "L3+sliced"])
@torch.no_grad()
def test_every_tier_is_exact(mode):
    block, args = _wan_block_case(tokens=700, dim=128)
    ref = block(*args)
    handle = streamplan.apply(block, **mode)
    out = block(*args)
    (plan,) = handle.plans[""]
    assert plan.tier == ("L3" if "head_groups" in mode else "L2")
    assert plan.head_groups == mode.get("head_groups", 1)
    assert rel_err(out, ref) <= 1e-5


@torch.no_grad()
def test_the_ladder_climbs_to_head_grouped_kv_when_whole_kv_does_not_fit():
    block, args = _wan_block_case()
    x = args[0]
    kv = 2 * x.numel() * 4
    live = sum(t.numel() * 4 for t in (args[0], args[1], args[2], *args[3]))
    # room for the residual copy, the attention output, an eighth of K and V and small chunks; not for whole K/V
    budget = live + 2 * x.numel() * 4 + kv // 8 + int(2.5 * MiB)
    ref = block(*args)
    handle = streamplan.apply(block, budget=budget)
    out, peak = streamplan.measure_peak(block, *args)
    (plan,) = handle.plans[""]
    assert plan.tier == "L3" and plan.head_groups > 1, handle.report()
    assert rel_err(out, ref) <= 1e-5
    assert peak <= budget - live
    # the graph's memory model is a bound (a fused entry's parts and their join alive together, views priced as their
    # base): over, never under, by up to 20% at these tiny widths
    assert peak <= plan.predicted_peak <= 1.2 * peak, (plan.predicted_peak / MiB, peak / MiB)


@torch.no_grad()
def test_the_default_is_the_auto_budget_and_costs_nothing_when_stock_fits():
    model = _llama(layers=1)
    ids = torch.randint(0, 100, (1, 300))
    ref = model(ids).last_hidden_state
    handle = streamplan.apply(model)
    assert handle.options.budget == "auto"
    assert torch.equal(model(ids).last_hidden_state, ref)
    assert set(_tiers(handle)) == {"L0"}, handle.report()


def test_planner_chosen_chunks_fill_whole_gpu_waves():
    from streamplan.plan.planner import Waves
    wan, flux, h3 = Waves(132, 40), Waves(132, 24), Waves(132, 56)   # H200: 132 multiprocessors
    assert (wan.quantum, flux.quantum, h3.quantum) == (4224, 1408, 4224)
    assert wan.round(9472, 65536) == 8448
    assert wan.round(70000, 65536) == 70000           # the whole sequence in one chunk: nothing to round
    assert Waves().round(3000, 65536) == 3000         # nothing known about the device: as the budget allows
    # below one quantum: the tile count whose last wave is fullest, never under 85% of what the budget allows
    assert h3.round(2816, 65536) == 21 * 128          # 22 tiles x 56 heads: 10 waves at 93%; 21: 9 waves at 99%
    assert wan.round(3000, 65536) == 23 * 128         # 23 tiles x 40 heads: 7 waves at 99.6%
    assert wan.round(2816, 65536) == 22 * 128         # 19 tiles would be 0.7% better per row: not worth 14% fewer
    for chunk in range(256, 4224, 97):
        got = h3.round(chunk, 65536)
        assert got % 128 == 0 and 0.85 * (chunk // 128 * 128) - 128 < got <= chunk


def test_a_narrower_mlp_slice_must_buy_rows_that_survive_wave_rounding():
    """H3 at 65,536 rows, donated, 1.10x the floor: 4096- and 2048-feature slices both run 12,672-row chunks once
    rounded to whole attention waves (56 heads on 132 multiprocessors: 4,224-row quanta), so the wider slice (4 GEMM
    passes, not 7) is the plan; a slice that buys a whole extra quantum is still taken; half the MLP at a time (2
    passes) where it fits as many rows."""
    from streamplan.plan.planner import Waves, plan_graph
    per_row = {0: 100, 7168: 60, 4096: 40, 2048: 33, 1024: 31.5}
    h200 = Waves(132, 56)
    kw = dict(budget=520_000, min_chunk=2048, waves=h200, ffn=14336)
    plan = plan_graph(65536, 0, lambda c, sl: int(c * per_row[sl]), 10**9, **kw)
    assert (plan.tier, plan.chunk, plan.ffn_slice) == ("L2", 12672, 4096), plan
    per_row[1024] = 29   # 17,931 rows: 16,896 once rounded, a quantum more than 4096's
    plan = plan_graph(65536, 0, lambda c, sl: int(c * per_row[sl]), 10**9, **kw)
    assert (plan.tier, plan.chunk, plan.ffn_slice) == ("L2", 16896, 1024), plan
    per_row.update({7168: 40, 1024: 31.5})   # half the MLP at a time fits 12,672 rows too: the widest is the plan
    plan = plan_graph(65536, 0, lambda c, sl: int(c * per_row[sl]), 10**9, **kw)
    assert (plan.tier, plan.chunk, plan.ffn_slice) == ("L2", 12672, 7168), plan


@torch.no_grad()
def test_the_report_says_what_the_plans_were_held_to_and_what_its_tier_codes_mean():
    model = _llama(layers=1)
    ids = torch.randint(0, 100, (1, 256))
    handle = streamplan.apply(model, chunk_tokens=64)
    model(ids)
    text = handle.report()
    handle.remove()
    assert "budget: none: fixed chunks of 64 rows (chunk_tokens)" in text and "budget: auto" not in text, text
    assert "tiers: " in text and "L1 row chunks" in text, text
    handle = streamplan.apply(model, budget="auto", reserve="1GiB")
    model(ids)
    text = handle.report()
    handle.remove()
    assert "budget: auto (the free device memory less a reserve of 1.00 GiB)" in text, text
    assert "tiers: L0 stock (the module's own forward)" in text, text


def test_a_phase_envelope_keeps_the_largest_line_at_every_row_count():
    """The memory model's lines (bytes = per row x rows + fixed) with the dominated ones dropped give the same worst
    moment as all of them at every row count: the planner's chunk search reads the envelope."""
    import random
    from streamplan.graph.memory import _at, _envelope
    rng = random.Random(0)
    for _ in range(200):
        lines = [(rng.randrange(0, 50_000), rng.randrange(0, 10**9)) for _ in range(rng.randrange(1, 60))]
        kept = _envelope(lines)
        assert len(kept) <= len(lines) and set(kept) <= set(lines)
        for rows in (1, 2, 7, 64, 1000, 8192, 65_536, 10**6):
            assert _at(kept, rows) == max(a * rows + b for a, b in lines)
