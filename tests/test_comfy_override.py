"""An opaque ComfyUI ``optimized_attention_override`` (one that did not opt in to the streamed contract) under
``streamplan.integrations.comfy.patch``: the block's attention is made once per block call with the whole Q, as stock
makes it,
and the rest of the block streams; blocks that cannot take that call stay stock, saying why. The override here is the
user's code, registered the way ComfyUI nodes register one (``transformer_options["optimized_attention_override"]``)."""
from __future__ import annotations

import sys

import pytest
import torch

import streamplan
from streamplan.plan.planner import Tier
from conftest import rel_err
from test_comfy import (_block_lines, _h3_run, flux_patcher, fresh_captures, h3_patcher,  # noqa: F401
                        sample_call, wan_patcher)

pytestmark = pytest.mark.usefixtures("fresh_captures")
FULL_Q = "full Q for an opaque attention override"


def _override(calls: list):
    """A node's override: attends through ComfyUI's own function, noting what each call was given."""

    def node_override(func, *args, **kwargs):
        options = kwargs["transformer_options"]
        calls.append((tuple(tuple(t.shape) for t in args[:3]), args[3:], sorted(kwargs),
                      options.get("block_index"), options.get("optimized_attention_override") is node_override))
        return func(*args, **kwargs)

    return node_override


def test_h3_opaque_override_gets_one_full_q_call(monkeypatch):
    """H3's blocks stream with the attention made once per block call with all 279 query rows, the override seeing
    the call stock makes (same tensors' shapes, arguments, transformer_options); output within fp32 1e-5 of stock with
    the same override, measured peak below stock's, each block call's measured peak within its plan's prediction
    (whole Q + K + V + attention output + one chunk), the report naming the override."""
    import streamplan.integrations.comfy as sc
    block_peaks: list = []
    streamed_call = sys.modules["streamplan.integrations.comfy.patch"]._StreamedCall
    through = streamed_call.__call__

    def measured(self, *args, **kwargs):
        out, peak = streamplan.measure_peak(through, self, *args, **kwargs)
        block_peaks.append(peak)
        return out

    calls: list = []
    override = _override(calls)
    base, x, cond = h3_patcher()
    stock, stock_peak = streamplan.measure_peak(
        sample_call, _h3_run(base, optimized_attention_override=override), x, cond)
    stock_calls = list(calls)
    assert [c[0][0] for c in stock_calls] == [(1, 2, 279, 32)] * 2, stock_calls   # one call per block, whole Q
    calls.clear()
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0), optimized_attention_override=override)
    out, peak = streamplan.measure_peak(sample_call, run, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert calls == stock_calls, (calls, stock_calls)
    assert peak < stock_peak, (peak, stock_peak)
    text = sc.report(run)
    sections = _block_lines(text)
    for name in ("double_block.0", "double_block.1"):
        assert sections[name].startswith(f"  {name}: 1 call(s) through the streamer"), text
        assert (f"attention in one call with the whole Q to _override.<locals>.node_override: "
                f"{FULL_Q}") in sections[name], text
        assert "L1 rows=279 chunk=64  q=whole (one attention call)" in sections[name], text
        assert "ran stock" not in sections[name], text
    monkeypatch.setattr(streamed_call, "__call__", measured)   # per block, in a run of its own: CPU meters do not nest
    calls.clear()
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    plans = [p for r in run.model_options["transformer_options"]["patches_replace"]["dit"].values()
             for ps in r.state.blocks[r.key].streamer.handle.plans.values() for p in ps]
    assert [p.q for p in plans] == ["whole", "whole"] and len(block_peaks) == 2, plans
    for plan, peak in zip(plans, block_peaks):
        assert 0.9 * plan.predicted_peak <= peak <= plan.predicted_peak, (block_peaks, plans)


def test_planner_prices_the_whole_q():
    """A consumer that needs every query row in one call: the plan holds the whole Q and attention output beside K, V
    and one chunk's transient, never splits the call into head groups or K/V blocks, and a budget that held chunked Q
    takes a smaller chunk or none."""
    from streamplan.plan.planner import BudgetError, KVOption, Tier, plan_graph
    rows, fixed, whole = 8192, 1000, 4000

    def transient(c: int, sl: int) -> int:
        return c

    def plan(**kw):
        return plan_graph(rows, fixed, transient, 10 ** 9, kv=800, attn_out=300, groups=(2, 4),
                          kv_options=(KVOption("host", Tier.L4, 0, 1, 1, host_bytes=800),), **kw)

    chunked = plan(budget=fixed + 4096)
    assert (chunked.tier, chunked.chunk, chunked.q) == (Tier.L1, 4096, "chunks")
    whole_plan = plan(budget=fixed + whole + 4096, whole_q=whole)
    assert (whole_plan.tier, whole_plan.chunk, whole_plan.q, whole_plan.head_groups, whole_plan.kv) == (
        Tier.L1, 4096, "whole", 1, "device")
    assert whole_plan.predicted_peak == fixed + whole + 4096
    assert "q=whole" in whole_plan.describe()
    assert 768 <= plan(budget=fixed + whole + 1024, whole_q=whole).chunk <= 1024 < plan(budget=fixed + 4096).chunk
    with pytest.raises(BudgetError):   # L3 and L4 would fit; neither takes one whole-Q call
        plan(budget=fixed + whole // 2, whole_q=whole)
    assert plan(chunk_tokens=512, whole_q=whole).q == "whole"
    assert plan(head_groups=2, chunk_tokens=512, whole_q=whole).head_groups == 1


def test_opaque_override_on_the_streamed_contract_path_unchanged():
    """The chunked paths are not touched: no override, Q chunks to ComfyUI's attention (no whole-Q plan)."""
    import streamplan.integrations.comfy as sc
    base, x, cond = h3_patcher()
    stock = sample_call(_h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    assert torch.equal(sample_call(run, x, cond), stock)
    text = sc.report(run)
    assert FULL_Q not in text and "q=whole" not in text, text


def test_wan_opaque_override_stays_stock():
    """A Wan block's stock forward calls the attention twice (self and text cross-attention): one full-Q call would
    hide the cross-attention from the override (a node's guidance on text attention, say). The block stays stock,
    exactly, the override called as stock calls it, the reason reported."""
    import streamplan.integrations.comfy as sc
    calls: list = []
    override = _override(calls)
    base, x, cond = wan_patcher(layers=1)
    stock_run = base.clone()
    stock_run.model_options["transformer_options"]["optimized_attention_override"] = override
    stock = sample_call(stock_run, x, cond)
    stock_calls = list(calls)
    assert len(stock_calls) == 2, stock_calls
    calls.clear()
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    run.model_options["transformer_options"]["optimized_attention_override"] = override
    assert torch.equal(sample_call(run, x, cond), stock)
    assert calls == stock_calls
    assert "1 call(s) stock: an opaque optimized_attention_override (_override.<locals>.node_override) may need " \
        "every query row at once" in sc.report(run), sc.report(run)


def test_flux_single_blocks_give_an_opaque_override_the_whole_q():
    """Flux's single-stream blocks attend once over their joint text + image rows: under an opaque override each
    makes that call once with the whole Q, as stock makes it, the rest streaming; the double blocks (text rows joined
    to the image rows inside the block) stay stock, saying why. Output within 1e-5 of stock with the same override,
    the override called exactly as stock calls it."""
    import streamplan.integrations.comfy as sc
    calls: list = []
    override = _override(calls)
    base, x, cond = flux_patcher()
    stock_run = base.clone()
    stock_run.model_options["transformer_options"]["optimized_attention_override"] = override
    stock = sample_call(stock_run, x, cond)
    stock_calls = list(calls)
    assert len(stock_calls) == 4, stock_calls   # two double, two single blocks: one call each, whole Q
    calls.clear()
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    run.model_options["transformer_options"]["optimized_attention_override"] = override
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert calls == stock_calls, (calls, stock_calls)
    sections = _block_lines(sc.report(run))
    for name in ("single_block.0", "single_block.1"):
        assert sections[name].startswith(f"  {name}: 1 call(s) through the streamer"), sections[name]
        assert FULL_Q in sections[name] and "q=whole (one attention call)" in sections[name], sections[name]
    for name in ("double_block.0", "double_block.1"):
        assert "1 call(s) stock: an opaque optimized_attention_override" in sections[name], sections[name]


if __name__ == "__main__":
    pytest.main([__file__])


def _whole_q_consumer():
    """A third-party consumer that needs every query row at once (``ConsumerCaps(bounded_q=False)``)."""
    import dataclasses

    from conftest import RecordingConsumer
    consumer = RecordingConsumer()
    consumer.caps = dataclasses.replace(consumer.caps, bounded_q=False)
    return consumer


@pytest.mark.parametrize("name", ["wan", "flux_double"])
@torch.no_grad()
def test_a_consumer_that_needs_the_whole_q_outside_comfyui(name):
    """The executor's path is not ComfyUI's alone: a registered consumer without bounded Q gets one call with every
    query row on a block with one global attention (diffusers' Wan block: exact, the rest streamed); a block whose
    text rows are joined to its own (diffusers' Flux double block) stays stock, saying why."""
    from streamplan.tools.catalogue.diffusers_cases import CASES
    from streamplan.attention import graph_consumer_scope
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    module = CASES[name].build()
    rows = 1024
    args, kwargs = CASES[name].inputs(rows, torch.device("cpu"), torch.float32)
    ref = module(*args, **kwargs)
    consumer = _whole_q_consumer()
    handle = streamplan.apply(module, chunk_tokens=256, capture="prefer")
    try:
        with graph_consumer_scope(consumer):
            out = module(*args, **kwargs)
        text = handle.report()
        if name == "wan":
            (plan,) = handle.plans[""]
            assert (plan.tier, plan.q, plan.chunk) == (Tier.L1, "whole", 256), text
            assert consumer.calls == [(rows, 0, rows, False)], consumer.calls
            assert rel_err(out, ref) <= 1e-5
        else:
            assert consumer.calls == [], consumer.calls
            assert "ran stock: attention backend recording needs the whole Q in one call, and" in text, text
            assert "static rows are joined" in text, text
            for a, b in zip(out, ref):
                assert torch.equal(a, b)
    finally:
        handle.remove()
