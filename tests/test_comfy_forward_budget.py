"""A size budget on a ComfyUI model forward streamplan runs itself (Wan, MiniMax-H3, LTX-2, LTX-Video, Flux, Chroma,
HunyuanVideo) is a promise for the whole forward (streamplan/integrations/comfy/forward_budget.py): the streamed
forward is rehearsed on fake tensors before its first op, its blocks planning as they will beside the forward's own
whole-row tensors. Accepted budgets hold by the meter over the whole model forward (above what was allocated when it
began) with the output ComfyUI's own; refused ones raise ``BudgetError`` before any block runs, with
``smallest_bytes``; that budget runs within itself. ComfyUI 0.33.0's own model classes in a real BaseModel and
ModelPatcher, through ``apply_model``, fp32 on CPU."""
from __future__ import annotations

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import _h3_long, _h3_run, _wan_long, fresh_captures, sample_call  # noqa: F401
from test_comfy import flux_patcher, hunyuan_video_patcher, ltxv_patcher
from test_comfy_ltxav import ltxav_call, ltxav_patcher
from test_comfy_models import _generic

pytestmark = pytest.mark.usefixtures("fresh_captures")


def _metered(base):
    """``base`` with an outer DIFFUSION_MODEL wrapper (added before ``patch``, so streamplan's runs inside it) that
    measures each model forward's peak: what the forward adds above what was allocated when it began."""
    import comfy.patcher_extension as ext
    peaks: list[int] = []

    def meter(executor, *args, **kwargs):
        if torch._C._autograd._profiler_enabled():   # the whole call is being measured already (a refusal)
            peaks.append(None)
            return executor(*args, **kwargs)
        out, peak = streamplan.measure_peak(lambda: executor(*args, **kwargs))
        peaks.append(peak)
        return out

    ext.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "meter", meter, base.model_options,
                             is_model_options=True)
    return peaks


def _long(name):
    """(base, x, cond, rows, width, blocks): the family's tiny model on about 4,096 rows of its hidden width (chunk
    transients small beside them), as the family's own ComfyUI tests build it, and its block count."""
    if name == "wan":
        return (*_wan_long(), 64, 2)
    if name == "h3":
        return (*_h3_long(), 64, 2)
    if name == "ltxav":
        base = ltxav_patcher()
        return (base, *ltxav_call(base, frames=16), 16 * 16 * 16, 64, 2)   # and 20 audio rows
    if name == "ltxv":
        base, _, cond = ltxv_patcher()
        return base, torch.randn(1, 8, 4, 32, 32), cond, 4096, 64, 2
    if name == "flux":
        base, _, cond = flux_patcher()
        return base, torch.randn(1, 4, 128, 128), cond, 64 * 64, 64, 4   # and 9 text rows
    if name == "chroma":
        base, _, cond = _generic("chroma")
        return base, torch.randn(1, 4, 128, 128), cond, 64 * 64, 64, 4   # and 7 text rows
    base, _, cond = hunyuan_video_patcher()
    return base, torch.randn(1, 4, 4, 64, 64), cond, 4 * 32 * 32, 64, 4   # and 9 text rows


def _family(name):
    comfyui()
    base, x, cond, rows, width, blocks = _long(name)
    run = _h3_run if name == "h3" else (lambda p: p)
    return base, x, cond, run, rows * width * 4, blocks   # the forward's fp32 hidden state


def _state(patched):
    import streamplan.integrations.comfy as sc
    (state,) = sc.patch.__globals__["_states"](patched)
    return state


def _refused(patched, x, cond):
    try:
        sample_call(patched, x, cond)
    except streamplan.BudgetError as exc:
        return exc
    return None


@pytest.mark.parametrize("name", ["wan", "h3", "ltxav", "ltxv", "flux", "chroma", "hunyuan_video"])
def test_a_comfy_forward_is_held_to_its_budget_or_refused_before_it_runs(name):
    import streamplan.integrations.comfy as sc
    base, x, cond, run, hidden, blocks = _family(name)
    peaks = _metered(base)
    stock = sample_call(run(base), x, cond)
    (stock_peak,) = peaks
    weights = {k: v.clone() for k, v in base.model.state_dict().items()}
    x0, cond0 = x.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in cond.items()}

    # refused: before any block ran, nothing of the model or the inputs changed, no whole-row tensor allocated
    patched = run(sc.patch(base, budget=stock_peak // 50, min_tokens=0))
    err, refused_peak = streamplan.measure_peak(_refused, patched, x, cond)
    assert isinstance(err, streamplan.BudgetError), err
    smallest = err.smallest_bytes
    assert isinstance(smallest, int) and stock_peak // 50 < smallest < stock_peak, (str(err), stock_peak)
    assert "cannot hold the whole forward" in str(err) and "nothing ran" in str(err), str(err)
    assert refused_peak < hidden, (refused_peak, hidden)
    state = _state(patched)
    assert state.forward.streamed_calls == 0 and state.forward.planned == {}
    assert all(b.streamed_calls == b.stock_calls == b.short_calls == 0 for b in state.blocks.values())
    assert all(not e.plans for b in state.blocks.values() if b.streamer for e in [b.streamer.entry])
    assert torch.equal(x, x0) and all(torch.equal(v, cond0[k]) for k, v in cond.items()
                                      if isinstance(v, torch.Tensor))
    assert all(torch.equal(v, weights[k]) for k, v in base.model.state_dict().items()), "the model is as it was"
    assert len(peaks) == 2, "the refused call entered the model forward once"

    # accepted: held over the whole forward by the meter, ComfyUI's output, every block call planned ahead
    for budget in (smallest, (smallest + stock_peak) // 2, 2 * stock_peak):
        patched = run(sc.patch(base, budget=budget, min_tokens=0))
        out = sample_call(patched, x, cond)
        text = sc.report(patched)
        assert rel_err(out, stock) <= 1e-5, (budget, text)
        assert peaks[-1] <= budget, (name, budget, peaks[-1], smallest, stock_peak, text)
        assert "the whole forward planned ahead" in text and "planned during the real call" not in text, text
        assert text.count("1 call(s) through the streamer") == blocks, text
        print(f"{name}: budget {budget / smallest:.2f}x smallest: peak {peaks[-1] / budget:.3f} of it "
              f"(stock {stock_peak}, smallest {smallest})")


def test_a_second_call_reuses_the_plan_and_auto_and_none_keep_their_meaning():
    """The forward is rehearsed once per input signature and sampling run; "auto" and None never plan ahead (each
    block plans as it runs, "auto" never refuses)."""
    import streamplan.integrations.comfy as sc
    base, x, cond, run, _, _ = _family("wan")
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=2**30, min_tokens=0)
    sample_call(patched, x, cond)
    (figures,) = _state(patched).forward.planned.values()
    plans = {id(p) for b in _state(patched).blocks.values() for p in b.streamer.entry.plans.values()}
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    assert _state(patched).forward.planned == {next(iter(_state(patched).forward.planned)): figures}
    assert {id(p) for b in _state(patched).blocks.values() for p in b.streamer.entry.plans.values()} == plans
    for budget in ("auto", None):
        patched = sc.patch(base, budget=budget, min_tokens=0)
        assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
        assert _state(patched).forward.planned == {} and "planned ahead" not in sc.report(patched)


@pytest.mark.parametrize("name, blocks", [("flux", "single_blocks"), ("ltxav", "transformer_blocks")])
def test_a_forward_with_quantized_blocks_is_not_planned_ahead(name, blocks, monkeypatch):
    """Quantized layouts take row chunks only, never a byte budget: where any block list of the model (Flux's single
    blocks, LTX-2's transformer blocks) holds one, the forward plans block by block, said in the report, and its
    output is ComfyUI's."""
    import sys

    import streamplan.integrations.comfy as sc
    comfyui()
    base, x, cond, run, _, _ = _family(name)
    target = getattr(base.model.diffusion_model, blocks)[-1]
    quantized = lambda block: ["ff.0"] if block is target else []   # noqa: E731 -- what the check reads, per block
    for module in ("patch", "forward_budget"):
        monkeypatch.setattr(sys.modules[f"streamplan.integrations.comfy.{module}"], "quantized_layers", quantized)
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=2**30, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    index = len(getattr(base.model.diffusion_model, blocks)) - 1
    assert f"{blocks}[{index}] holds quantized weights (ff.0, ...)" in text, text
    assert "the whole forward planned ahead" not in text and _state(patched).forward.planned == {}, text


@pytest.mark.parametrize("name", ["wan", "h3", "ltxav", "ltxv", "flux", "hunyuan_video"])
def test_k_and_v_in_host_memory_run_a_comfy_forward_below_their_floor_on_the_card(name):
    """Where ComfyUI attends with PyTorch SDPA, a streamed block's K and V can be staged to the host (L4; forced here
    with ``kv="host"``: on CUDA the planner takes it on its own below the floor): the smallest budget falls below
    the one with K and V whole on the card, and it holds, exact against ComfyUI's own forward."""
    import streamplan.integrations.comfy as sc
    base, x, cond, run, _, blocks = _family(name)
    peaks = _metered(base)
    stock = sample_call(run(base), x, cond)
    (stock_peak,) = peaks
    on_card = _refused(run(sc.patch(base, budget=stock_peak // 50, min_tokens=0)), x, cond).smallest_bytes
    staged = _refused(run(sc.patch(base, budget=stock_peak // 50, min_tokens=0, kv="host")), x, cond).smallest_bytes
    assert staged < on_card, (staged, on_card)
    patched = run(sc.patch(base, budget=staged, min_tokens=0, kv="host"))
    out = sample_call(patched, x, cond)
    text = sc.report(patched)
    assert rel_err(out, stock) <= 1e-5, text
    assert peaks[-1] <= staged, (peaks[-1], staged, on_card, text)
    assert text.count("tiers: L4 K/V staged in host memory (exact)") == blocks, text
    assert "kv host" in text and "K/V store blocks by PyTorch SDPA" in text, text
    print(f"{name}: smallest {staged} with K/V on the host against {on_card} on the card; peak {peaks[-1]}")


def test_a_store_runs_on_pytorch_sdpa_where_comfyui_attends_with_another_function(monkeypatch):
    """A store merges K/V blocks by their log-sum-exp, which ComfyUI's attention functions do not return: with
    another function than its PyTorch SDPA one (here the split one, as ``--use-split-cross-attention`` selects) a
    stored block's attention runs on PyTorch's kernels, block by block, instead of ComfyUI's function; exact, and the
    report says so. Named (``kv="host"``) it is taken; left to the planner, only where K/V on the card do not fit
    (``test_a_last_resort_store_only_where_nothing_on_the_card_fits``)."""
    import comfy.ldm.modules.attention as attention

    import streamplan.integrations.comfy as sc
    base, x, cond, run, _, blocks = _family("h3")
    stock = sample_call(run(base), x, cond)
    monkeypatch.setattr(attention, "optimized_attention", attention.attention_split)
    assert rel_err(sample_call(run(base), x, cond), stock) <= 1e-5   # ComfyUI's own forward on the split function
    patched = run(sc.patch(base, budget=None, chunk_tokens=512, min_tokens=0, kv="host"))
    out = sample_call(patched, x, cond)
    text = sc.report(patched)
    assert rel_err(out, stock) <= 1e-5, text
    assert text.count("tiers: L4 K/V staged in host memory (exact)") == blocks, text
    assert "only where K/V on the card do not fit, by PyTorch SDPA with their log-sum-exp" in text, text
    assert "kv=host not used" not in text, text
