"""A budget on a model forward streamplan runs itself is a promise for the whole forward: the forward is rehearsed on
fake tensors before it runs, every tensor it holds over the rows counted beside each block's work. Accepted budgets
hold (the meter, over the whole forward, above what was allocated before the call); refused ones raise before
anything runs, saying the smallest budget that runs; that budget runs within itself. Whole tiny Wan, MiniMax-H3 and
Llama, against the real libraries' forwards."""
import pytest
import torch

import streamplan
from conftest import rel_err
from test_blocks import _wan_model
from test_h3_model import _inputs as _h3_inputs, _model as _h3_model
from test_llm_models import _ids, _lm


def _wan():
    torch.manual_seed(0)
    model = _wan_model()
    x, t, enc = torch.randn(1, 4, 8, 32, 32), torch.tensor([500]), torch.randn(1, 7, 32)   # 2,048 rows
    return model, (lambda: model(x, t, enc).sample), (x, t, enc)


def _h3():
    torch.manual_seed(0)
    model, kw = _h3_model(layers=2), _h3_inputs(target=1400)
    return model, (lambda: model(**kw).sample), tuple(kw.values())


def _llama():
    model, ids = _lm("llama"), _ids(batch=1, n=2048)
    return model, (lambda: model(ids, use_cache=False, logits_to_keep=1).logits), (ids,)


MODELS = {"wan": _wan, "minimax_h3": _h3, "llama": _llama}


def _refusal(model, call, budget) -> streamplan.BudgetError:
    handle = streamplan.apply(model, budget=budget)
    try:
        with pytest.raises(streamplan.BudgetError) as err:
            call()
        left = [p for ps in handle.plans.values() for p in ps]
    finally:
        handle.remove()
    assert left == [], "a refused forward keeps no plan"
    return err.value


@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_a_whole_forward_is_held_to_its_budget_or_refused_before_it_runs(name):
    model, call, inputs = MODELS[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs0 = [t.clone() for t in inputs]
    ref, stock_peak = streamplan.measure_peak(call)

    err = _refusal(model, call, stock_peak // 50)
    smallest = err.smallest_bytes
    assert isinstance(smallest, int) and stock_peak // 50 < smallest < stock_peak, str(err)
    assert "cannot hold the whole forward" in str(err) and "nothing ran" in str(err), str(err)
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs0))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model is as it was"

    for budget in (smallest, (smallest + stock_peak) // 2, 2 * stock_peak):
        handle = streamplan.apply(model, budget=budget)
        out, peak = streamplan.measure_peak(call)
        assert rel_err(out, ref) <= 1e-5, (budget, handle.report())
        assert peak <= budget, (name, budget, peak, smallest, handle.report())
        (plan,) = handle.plans[""]
        assert plan.predicted_total <= budget and "planned ahead" in plan.note or plan.tier == "L0", handle.report()
        handle.remove()
    # the same smallest again (within what a first call's caches add: MiniMax-H3 keeps its small rotary tables)
    again = _refusal(model, call, int(smallest * 0.97)).smallest_bytes
    assert 0.99 * smallest <= again <= smallest, (again, smallest)


@torch.no_grad()
def test_a_refused_forward_allocates_nothing_on_the_device():
    """Nothing of the forward ran: the refused call's own peak is the rehearsal's few small real values."""
    model, call, _ = _wan()
    _, stock_peak = streamplan.measure_peak(call)
    handle = streamplan.apply(model, budget=stock_peak // 50)
    refused, peak = streamplan.measure_peak(lambda: _raised(call))
    handle.remove()
    assert isinstance(refused, streamplan.BudgetError)
    assert peak < stock_peak // 50, (peak, stock_peak)


def _raised(call):
    try:
        call()
    except streamplan.BudgetError as exc:
        return exc
    return None


@torch.no_grad()
def test_smallest_when_short_runs_the_forward_at_its_smallest_instead_of_refusing():
    model, call, _ = _wan()
    ref, stock_peak = streamplan.measure_peak(call)
    smallest = _refusal(model, call, stock_peak // 50).smallest_bytes
    options = streamplan.StreamOptions(budget=stock_peak // 50, smallest_when_short=True)
    handle = streamplan.apply(model, options=options)
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out, ref) <= 1e-5 and peak <= smallest, (peak, smallest)
    assert "below the smallest this forward reaches" in handle.report(), handle.report()
    handle.remove()


def _cast(model):
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def _group_offload(model):
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)


def _sequential_offload(model):
    from accelerate import cpu_offload
    cpu_offload(model, execution_device=torch.device("cpu"))


WEIGHT_HOOKS = {"layerwise_casting": _cast, "group_offloading": _group_offload,
                "sequential_offload": _sequential_offload}


@pytest.mark.parametrize("hooks", list(WEIGHT_HOOKS))
@torch.no_grad()
def test_a_forward_under_weight_moving_hooks_is_held_to_its_budget_weights_included(hooks):
    """Offload and casting hooks are set aside in the rehearsal, the weights they bring stood in on the device and
    counted beside the forward's work. Layerwise casting makes fp32 copies of each layer's fp8 weights during its
    call: the smallest budget counts them (without them the measured peak would exceed it)."""
    model, call, inputs = _wan()
    WEIGHT_HOOKS[hooks](model)
    ref, stock_peak = streamplan.measure_peak(call)
    where = {k: (t.device, t.dtype) for k, t in model.state_dict(keep_vars=True).items()}
    err = _refusal(model, call, stock_peak // 50)
    smallest = err.smallest_bytes
    # the hooks around the forward brought the model's own weights in before it refused: put back as they were
    assert {k: (t.device, t.dtype) for k, t in model.state_dict(keep_vars=True).items()} == where
    assert stock_peak // 50 < smallest < stock_peak, str(err)
    for budget in (smallest, (smallest + stock_peak) // 2):
        handle = streamplan.apply(model, budget=budget)
        out, peak = streamplan.measure_peak(call)
        assert rel_err(out, ref) <= 1e-5, handle.report()
        assert peak <= budget, (hooks, budget, peak, smallest, handle.report())
        (plan,) = handle.plans[""]
        assert "planned ahead" in plan.note, handle.report()
        if hooks == "layerwise_casting":
            assert "of weights its hooks bring in" in plan.note, plan.note
        handle.remove()
    assert all(p.device.type == "meta" for p in model.blocks[0].parameters()) == (hooks == "sequential_offload")


@torch.no_grad()
def test_a_causal_lm_with_its_layers_offloaded_is_planned_whole_weights_included():
    """accelerate's hook on each decoder layer (what ``device_map`` with layers on "cpu" installs): the layers are
    called through their own forwards, so the model forward streams around them and counts the layer in flight."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from streamplan.execute.hook_chains import weights_in_flight
    model, call, inputs = _llama()
    ref, stock_peak = streamplan.measure_peak(call)
    for layer in model.model.layers:
        weights = {k: v.clone() for k, v in layer.state_dict().items()}
        add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("cpu"), offload=True,
                                                   weights_map=weights, place_submodules=True))
    layer_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    smallest = _refusal(model, call, stock_peak // 50).smallest_bytes
    assert smallest > layer_bytes, (smallest, layer_bytes)
    handle = streamplan.apply(model, budget=smallest)
    # the model forward calls its layers one at a time: one layer's weights in flight, never all of them
    assert weights_in_flight(model) == layer_bytes
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out, ref) <= 1e-5, handle.report()
    assert peak <= smallest, (peak, smallest, handle.report())
    (plan,) = handle.plans[""]
    assert "planned ahead" in plan.note and "of weights its hooks bring in" in plan.note, plan.note
    handle.remove()
    assert all(p.device.type == "meta" for p in model.model.layers[0].parameters())


@torch.no_grad()
def test_weights_in_flight_count_the_root_for_the_whole_call_and_the_largest_block_at_once():
    """Sequential offload brings each leaf's weights for its call; inside a streamed block every leaf's come at once
    (the graph reads them all), so the largest unit is the largest block; the model's own parameters stay for the
    whole call."""
    from streamplan.execute.hook_chains import weights_in_flight
    model, call, _ = _wan()
    nbytes = {name: sum(p.numel() * p.element_size() for p in m.parameters()) for name, m in model.named_children()}
    own = sum(p.numel() * p.element_size() for p in model.parameters(recurse=False))
    block = nbytes.pop("blocks") // len(model.blocks)
    leaves = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
              for name, m in model.named_modules() if not name.startswith("blocks")]
    _sequential_offload(model)
    handle = streamplan.apply(model, budget=1 << 30)
    assert weights_in_flight(model) == own + max(block, *leaves)
    handle.remove()
    assert weights_in_flight(model) == own + max(leaves + [
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.blocks.modules()])


@torch.no_grad()
def test_a_forward_with_hooks_is_planned_block_by_block_and_says_so():
    model, call, _ = _wan()
    ref = call()
    hook = model.blocks[1].register_forward_hook(lambda m, a, o: None)
    handle = streamplan.apply(model, budget=1 << 30)
    out = call()
    assert rel_err(out, ref) <= 1e-5
    assert "the whole forward was not planned ahead (blocks.1 has forward hooks)" in handle.report(), handle.report()
    handle.remove()
    hook.remove()


@torch.no_grad()
def test_a_forward_with_fused_chains_is_planned_ahead_on_its_first_call(monkeypatch):
    """A fused chain checks its compiled form against its eager ops on real values; a rehearsal (fake tensors) runs
    the chain's eager ops instead, so the first call is planned ahead too and the real call checks and fuses."""
    from streamplan.graph import fused_chains
    monkeypatch.setattr(fused_chains, "_COMPILED", {})   # no chain checked by an earlier test
    model, call, _ = _wan()
    ref, stock_peak = streamplan.measure_peak(call)
    budget = stock_peak // 2
    handle = streamplan.apply(model, budget=budget, fuse=True)
    out, peak = streamplan.measure_peak(call)
    (plan,) = handle.plans[""]
    assert "planned ahead" in plan.note, handle.report()
    assert "each ran as one compiled kernel, exact" in handle.report(), handle.report()
    assert rel_err(out, ref) <= 1e-5 and peak <= budget, (peak, budget)
    handle.remove()


@torch.no_grad()
def test_a_rehearsal_runs_each_distinct_block_once_and_predicts_as_if_it_ran_them_all(monkeypatch):
    """Blocks 1.. are twins of block 0 (same structure, same call): their rehearsal is replayed from block 0's, the
    plans copied, and the forward's predicted peak is the one a rehearsal running every block finds."""
    from streamplan.execute import dispatch
    from streamplan.execute.call_state import rehearsing
    from streamplan.specs import GraphSpec
    model, call, _ = _wan()
    ref, stock_peak = streamplan.measure_peak(call)
    ran = []
    handler = dispatch.HANDLERS[GraphSpec]
    monkeypatch.setitem(dispatch.HANDLERS, GraphSpec, lambda ctx, a, k: (
        ran.append(ctx.entry.name) if rehearsing() else None, handler(ctx, a, k))[1])

    def planned():
        handle = streamplan.apply(model, budget=stock_peak // 2)
        out, peak = streamplan.measure_peak(call)
        plans = {name: [p.to_dict() for p in ps] for name, ps in handle.plans.items()}
        handle.remove()
        assert rel_err(out, ref) <= 1e-5 and peak <= stock_peak // 2
        return plans

    replayed = planned()
    assert ran == ["blocks.0"], ran
    ran.clear()
    monkeypatch.setattr(dispatch, "run_replayed", lambda ctx, a, k, h: h(ctx, a, k))
    every = planned()
    assert ran == ["blocks.0", "blocks.1", "blocks.2"], ran
    for plans in (replayed, every):   # the note says how long the rehearsal took: not compared
        plans[""][0]["note"] = plans[""][0]["note"].split(" in ")[0]
    assert replayed == every
    blocks = [str(ps) for name, ps in replayed.items() if name.count(".") == 1]
    assert len(blocks) == 3 and len(set(blocks)) == 1, blocks


@torch.no_grad()
def test_a_rehearsal_over_its_budget_is_planned_again_with_less_for_its_parts(monkeypatch):
    # tensors beside a call that its plan does not see (a per-chunk table's own intermediates, on LTX-2 at 8 GiB) put
    # the rehearsal's peak over the budget although every part planned within it: the forward is planned again with
    # its parts' budget lowered by the overshoot, not refused; the smallest a refusal names still runs
    from streamplan.execute import forward_plan
    model, call, _ = _wan()
    ref, stock_peak = streamplan.measure_peak(call)
    budget = int(0.5 * stock_peak)
    handle = streamplan.apply(model, budget=budget)
    call()
    plain = handle.plans[""][0].predicted_peak
    handle.remove()
    unseen = int(0.1 * budget)   # bytes the parts' plans do not see, in every rehearsal
    attempt = forward_plan._attempt

    def with_unseen(*a, **k):
        figures = attempt(*a, **k)
        figures.predicted += unseen
        return figures

    monkeypatch.setattr(forward_plan, "_attempt", with_unseen)
    handle = streamplan.apply(model, budget=budget)
    out = call()
    assert rel_err(out, ref) <= 1e-5
    root = handle.plans[""][0]
    assert plain + unseen > forward_plan.held(budget)   # the first pick, with what it does not see, is over
    assert root.predicted_peak <= forward_plan.held(budget), (root.predicted_peak, budget, handle.report())
    handle.remove()
    err = _refusal(model, call, budget // 8)
    handle = streamplan.apply(model, budget=err.smallest_bytes)
    assert rel_err(call(), ref) <= 1e-5   # planned within it: no refusal at the smallest it named
    handle.remove()


def test_a_cuda_budget_without_expandable_segments_says_what_the_card_also_holds():
    """A whole-forward budget counts allocated bytes; on a card the caching allocator's reserved, unused blocks count
    too (a 2-layer Llama under its smallest budget ran out with 631 MiB of them). The forward's report says so on CUDA
    unless expandable segments are set, in either variable torch reads; never on the CPU."""
    from streamplan.plan.budget import stranded_blocks_note
    cuda = torch.device("cuda", 0)
    said = stranded_blocks_note(cuda, {})
    assert said is not None and "expandable_segments:True" in said
    assert stranded_blocks_note(cuda, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == said
    for conf in ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                 {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:true"}):
        assert stranded_blocks_note(cuda, conf) is None, conf
    assert stranded_blocks_note(torch.device("cpu"), {}) is None
