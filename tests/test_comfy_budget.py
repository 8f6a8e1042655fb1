"""Budgets inside ComfyUI when the card is full (streamplan/integrations/comfy/memory.py), against a real ComfyUI
0.33.0: under
DynamicVRAM (comfy-aimdo) ComfyUI fills the card with weights it evicts on demand, so the free memory "auto" reads can
hold no plan where stock would still run (by evicting). "auto" then streams at the smallest peak the planner reaches,
reported; an explicit byte budget still refuses before any work runs."""
from __future__ import annotations

import re

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import (_block_lines, _h3_long, _h3_run, _wan_long, _without_wrapper,  # noqa: F401
                        fresh_captures, sample_call)

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_captures")
NOTE = "below the smallest peak it reaches: planned at that smallest peak"


def _free(monkeypatch, free: int) -> None:
    import comfy.model_management as mm
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: 0)


def _least(patcher, x, cond) -> int:
    """The smallest peak the planner reaches for the first block, from the refusal of a 64 KiB explicit budget (under
    the stock model forward: a forward streamplan runs is planned whole, and refuses as a whole)."""
    import streamplan.integrations.comfy as sc
    with pytest.raises(streamplan.BudgetError, match="below the smallest peak streamplan can reach") as err:
        sample_call(_without_wrapper(sc.patch(patcher, budget=2**16, min_tokens=0)), x, cond)
    m = re.search(r"smallest peak streamplan can reach \(([\d.]+) (KiB|MiB|GiB)", str(err.value))
    return int(float(m.group(1)) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)])


@pytest.mark.parametrize("family", ["wan", "h3"])
def test_auto_with_no_free_memory_streams_at_the_smallest_peak(monkeypatch, family):
    """ComfyUI reports nothing free (its evictable weights fill the card): "auto" does not refuse. Every block streams
    at the smallest peak the planner reaches (the explicit budget's refusal names the same figure), exactly, with a
    lower measured peak than the default chunk's, and the report says so; with room, "auto" plans as before."""
    comfyui()
    import streamplan.integrations.comfy as sc
    base, x, cond, rows = _wan_long() if family == "wan" else _h3_long()
    run = (lambda p: p) if family == "wan" else _h3_run
    stock = sample_call(run(base), x, cond)
    least = _least(run(base), x, cond)

    _free(monkeypatch, 0)
    patched = sc.patch(base, budget="auto", min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, run(patched), x, cond)
    assert rel_err(out, stock) <= 1e-5
    text = sc.report(run(patched))
    for key, b in next(iter(sc.patch.__globals__["_states"](run(patched)))).blocks.items():
        section = _block_lines(text)[f"{key[0]}.{key[1]}"]
        assert "1 call(s) through the streamer" in section and NOTE in section, text
        plan = next(iter(b.streamer.handle.plans.values()))[0]
        assert plan.predicted_peak <= least * 1.01 and plan.chunk < rows, (plan, least)
    _, default_peak = streamplan.measure_peak(
        sample_call, run(sc.patch(base, budget=None, chunk_tokens=2048, min_tokens=0)), x, cond)
    assert peak < default_peak, (peak, default_peak)

    _free(monkeypatch, 2**40)
    roomy = sc.patch(base, budget="auto", min_tokens=0)
    assert rel_err(sample_call(run(roomy), x, cond), stock) <= 1e-5
    assert NOTE not in sc.report(run(roomy))


def test_explicit_budget_still_refuses(monkeypatch):
    """An explicit budget is a ceiling: below the smallest peak it raises BudgetError before any work, naming that
    peak, whatever ComfyUI reports free; the layers are as ComfyUI left them."""
    comfyui()
    import streamplan.integrations.comfy as sc
    base, x, cond, _ = _wan_long()
    _free(monkeypatch, 2**40)
    least = _least(base, x, cond)
    assert least > 0
    with pytest.raises(streamplan.BudgetError):
        sample_call(sc.patch(base, budget=least // 2, min_tokens=0), x, cond)


def test_stream_blocks_node_says_what_it_does():
    """The "Stream Blocks" node tells the user what happens under lowvram, DynamicVRAM and LoRA (weights taken once
    per block call) and what "auto" and a size mean."""
    comfyui()
    from streamplan.integrations.comfy import nodes
    for words in ("lowvram", "DynamicVRAM", "LoRA", "once per block call", "min_tokens", "runs stock"):
        assert words in nodes.DESCRIPTION, words
    for words in ('"auto"', "--reserve-vram", "not counted as free", "smallest peak", "instead of failing",
                  '"12GiB"', "ceiling", "an error", '"none"'):
        assert words in nodes.BUDGET_TOOLTIP, words


def test_stream_blocks_schema_carries_the_texts():
    comfyui()
    from streamplan.integrations.comfy import nodes
    try:
        from comfy_api.latest import io  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- the vendored tree lacks ComfyUI's server-side modules
        pytest.skip(f"comfy_api.latest does not import here: {type(exc).__name__}: {exc}")
    schema = nodes.node_classes()[0].GET_SCHEMA()
    assert schema.description == nodes.DESCRIPTION
    assert next(i for i in schema.inputs if i.id == "budget").tooltip == nodes.BUDGET_TOOLTIP
