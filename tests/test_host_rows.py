"""L6: a model forward's hidden state in host memory between blocks. Below the smallest budget the forward reaches with
its hidden state on the device, the planner keeps it (and its rotary tables) in host memory, each block reading its
chunks back; the forward is the library's own to 1e-5 and held by the meter (host memory comes from an arena the meter
does not watch, as a GPU's pinned memory is not device memory). Whole tiny Wan and Llama against diffusers' and
transformers' forwards."""
import pytest
import torch

import streamplan
from conftest import rel_err
from test_forward_budget import WEIGHT_HOOKS, _h3, _llama, _wan
from test_llm_models import _ids, _lm


def _smallest(model, call, budget: int, **options) -> int:
    handle = streamplan.apply(model, budget=budget, **options)
    try:
        with pytest.raises(streamplan.BudgetError) as err:
            call()
    finally:
        handle.remove()
    return err.value.smallest_bytes


def _held(model, call, budget: int, ref, **options):
    handle = streamplan.apply(model, budget=budget, **options)
    out, peak = streamplan.measure_peak(call)
    (plan,) = handle.plans[""]
    report = handle.report()
    handle.remove()
    assert rel_err(out, ref) <= 1e-5, report
    assert peak <= budget, (budget, peak, report)
    return plan, peak, report


@pytest.mark.parametrize("build", [_wan, _h3, _llama], ids=["wan", "minimax_h3", "llama"])
@torch.no_grad()
def test_below_what_the_device_reaches_the_hidden_state_goes_to_host_memory(build):
    model, call, inputs = build()
    ref, stock_peak = streamplan.measure_peak(call)
    on_device = _smallest(model, call, stock_peak // 50, hidden="device")
    smallest = _smallest(model, call, stock_peak // 50)
    assert smallest < 0.8 * on_device, (smallest, on_device)

    plan, peak, report = _held(model, call, smallest, ref)
    assert plan.tier == "L6" and plan.host_bytes > 0, report
    assert "in host memory between blocks (L6)" in report and "of host memory at once" in report, report
    hidden = plan.rows * 64 * 4   # [1, rows, 64] fp32 (every tiny model is 64 wide): the residual off the device
    assert plan.host_bytes >= hidden, (plan.host_bytes, hidden)

    plan, _, report = _held(model, call, on_device, ref)   # the planner climbs to L6 only below the device's reach
    assert plan.tier == "L1", report


@torch.no_grad()
def test_a_decoder_model_alone_hands_its_last_hidden_state_back_on_the_device():
    lm, ids = _lm("llama"), _ids(batch=1, n=2048)
    model = lm.model
    ref = model(ids, use_cache=False).last_hidden_state
    handle = streamplan.apply(model, budget=None, chunk_tokens=256, hidden="host")
    out = model(ids, use_cache=False).last_hidden_state
    assert isinstance(out, torch.Tensor) and rel_err(out, ref) <= 1e-5, handle.report()
    assert str(handle.plans[""][0].tier) == "L6"
    handle.remove()


@torch.no_grad()
def test_the_hidden_state_in_host_memory_under_offload_hooks():
    """Group offloading and accelerate's hooks send a block's arguments to the device; the host rows stay put."""
    for install in (WEIGHT_HOOKS["group_offloading"], WEIGHT_HOOKS["sequential_offload"]):
        model, call, _ = _wan()
        install(model)
        ref, stock_peak = streamplan.measure_peak(call)
        smallest = _smallest(model, call, stock_peak // 50)
        plan, _, report = _held(model, call, smallest, ref)
        assert plan.tier == "L6", report


@torch.no_grad()
def test_forced_host_rows_with_host_kv_hold_less_than_the_same_plan_on_the_device():
    model, call, _ = _wan()
    ref = call()
    peaks = {}
    for hidden in ("device", "host"):
        handle = streamplan.apply(model, budget=None, chunk_tokens=256, kv="host", hidden=hidden)
        out, peaks[hidden] = streamplan.measure_peak(call)
        (plan,) = handle.plans[""]
        assert rel_err(out, ref) <= 1e-5 and str(plan.tier) == ("L6" if hidden == "host" else "L1"), handle.report()
        handle.remove()
    rows_bytes = 2048 * 64 * 4
    assert peaks["host"] <= peaks["device"] - rows_bytes, peaks


@torch.no_grad()
def test_a_block_that_cannot_read_host_rows_gets_them_whole():
    """With capture off the blocks are streamed by their parts, which take device tensors: the forward hands them
    the rows whole and puts the output back in host memory."""
    model, call, _ = _wan()
    ref = call()
    handle = streamplan.apply(model, budget=None, chunk_tokens=256, hidden="host", capture="off")
    out = call()
    assert rel_err(out, ref) <= 1e-5, handle.report()
    assert str(handle.plans[""][0].tier) == "L6"
    handle.remove()


@torch.no_grad()
def test_with_the_hidden_state_on_the_host_rotary_tables_are_built_a_chunk_at_a_time(monkeypatch):
    """At 1M tokens a Llama's whole (cos, sin) pair and its fp32 intermediates are 1.5 GiB: on the device they would
    outweigh everything else L6 keeps there. In host mode each chunk's rows are built from its positions."""
    lm, ids = _lm("llama"), _ids(batch=1, n=2048)
    ref = lm(ids, use_cache=False, logits_to_keep=1).logits
    rope = type(lm.model.rotary_emb)
    stock_forward, rows = rope.forward, []

    def counted(self, x, position_ids, *args, **kwargs):
        rows.append(position_ids.shape[-1])
        return stock_forward(self, x, position_ids, *args, **kwargs)

    monkeypatch.setattr(rope, "forward", counted)
    handle = streamplan.apply(lm, budget=None, chunk_tokens=256, hidden="host")
    out = lm(ids, use_cache=False, logits_to_keep=1).logits
    assert rel_err(out, ref) <= 1e-5, handle.report()
    assert str(handle.plans[""][0].tier) == "L6"
    assert rows and max(rows) <= 256, rows
    handle.remove()


@torch.no_grad()
def test_host_memory_that_cannot_be_had_is_an_error_before_anything_runs(monkeypatch):
    from streamplan.execute import host_rows
    model, call, inputs = _wan()
    ref, stock_peak = streamplan.measure_peak(call)
    smallest = _smallest(model, call, stock_peak // 50)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(host_rows, "host_available", lambda: 1000)
    handle = streamplan.apply(model, budget=smallest)
    with pytest.raises(streamplan.HostMemoryError) as err:
        call()
    assert err.value.available == 1000 and err.value.needed > 1000, str(err.value)
    assert "needs" in str(err.value) and "available" in str(err.value), str(err.value)
    assert handle.plans[""] == [], "nothing of the refused call is kept"
    monkeypatch.undo()
    out = call()   # with the memory there, the same handle runs
    assert rel_err(out, ref) <= 1e-5
    handle.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_hidden_is_checked():
    model, _, _ = _wan()
    with pytest.raises(ValueError, match="hidden must be one of 'auto', 'device', 'host'"):
        streamplan.apply(model, hidden="gpu")


@torch.no_grad()
def test_a_long_prefill_is_rehearsed_with_the_mask_the_real_call_uses():
    """Past a few thousand rows the positions a decoder makes itself are fake in the rehearsal; read by the mask
    functions' packed-sequence check they would look packed, and the rehearsal would plan a mask the real call never
    builds (and no host K/V store, which takes no mask)."""
    lm, ids = _lm("llama"), _ids(batch=1, n=12288)   # 96 KiB of ids: past what a rehearsal keeps real
    call = lambda: lm(ids, use_cache=False, logits_to_keep=1).logits  # noqa: E731
    ref, stock_peak = streamplan.measure_peak(call)
    plan, _, report = _held(lm, call, stock_peak // 2, ref)
    assert "planned ahead" in plan.note, report
    assert "mask built a Q chunk's rows at a time" not in report, report
