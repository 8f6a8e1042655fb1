"""The memory picture (issue 33): ``handle.timeline(path)`` writes a self-contained HTML file with a labelled row per
streamed call, and the measured peaks it writes are the meter's."""
import xml.etree.ElementTree as ET

import pytest
import torch

import streamplan
from streamplan import meter
from streamplan.execute.call_ledger import RANGE_PREFIX
from streamplan.timeline import render_html

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

SVG = "{http://www.w3.org/2000/svg}"
XHTML = "{http://www.w3.org/1999/xhtml}"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    from conftest import TINY_DECODER
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER, attn_implementation="sdpa")).eval()


def _wan_block():
    from streamplan.tools.catalogue.diffusers_cases import CASES
    torch.manual_seed(0)
    case = CASES["wan"]
    args, kwargs = case.inputs(512, torch.device("cpu"), torch.float32)
    return case.build(), args, kwargs


def _parse(path):
    root = ET.parse(path).getroot()   # well-formed: XHTML with inline SVG
    svgs = list(root.iter(f"{SVG}svg"))
    calls = [g for g in root.iter(f"{SVG}g") if g.get("class") == "call"]
    whole = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "whole-call")
    table_rows = [tr for tr in root.iter(f"{XHTML}tr") if tr.get("class") == "call"]
    return root, svgs, calls, whole, table_rows


@torch.no_grad()
def test_the_timeline_renders_a_labelled_row_per_call_with_the_meters_numbers(tmp_path):
    model = _llama()
    ids = torch.randint(0, 100, (1, 700))
    _, stock = streamplan.measure_peak(lambda: model(ids, use_cache=False))
    handle = streamplan.apply(model, budget="1MiB")
    try:
        _, peak = streamplan.measure_peak(lambda: model(ids, use_cache=False))
        timeline = handle.timeline(tmp_path / "t.html", stock_peak=stock)
        records = list(handle.calls)
    finally:
        handle.remove()
    root, svgs, calls, whole, table_rows = _parse(tmp_path / "t.html")
    assert len(svgs) == 1 and not list(root.iter(f"{XHTML}script"))      # inline SVG, nothing to run or fetch
    text = (tmp_path / "t.html").read_text()
    assert "http" not in text.replace("http://www.w3.org/", "")             # no external file or address
    # a row per streamed call, labelled with its module, in the picture and in the table
    assert len(calls) == len(table_rows) == len(records) == len(timeline.rows) > 2
    names = [g.get("data-name") for g in calls]
    assert "model.layers.0" in names and "model.layers.1" in names
    for g, rec in zip(calls, records):
        label = "".join(g.find(f"{SVG}text").itertext())
        assert (rec.name or "<root>") in label and g.get("data-name") == (rec.name or "<root>")
    # the whole call's measured peak is what measure_peak returned; stock's is the one given
    assert int(whole.get("data-own")) == peak == timeline.call_own
    assert int(whole.get("data-measured")) == peak + handle.call_inputs
    assert int(whole.get("data-stock-measured")) == stock + handle.call_inputs
    # each call's measured peak is the meter's for that call's range, on the row's baseline (its inputs added)
    for g, rec, row in zip(calls, records, timeline.rows):
        seen = meter.range_peak(rec.tag)
        assert seen is not None and seen.call_peak == peak
        assert int(g.get("data-own")) == seen.own == row.own and seen.peak <= peak
        assert int(g.get("data-measured")) == row.inputs + seen.own
    blocks = [row for row in timeline.rows if row.name.startswith("model.layers.")]
    assert blocks and all(row.tier != "L0" and {p.name for p in row.phases} >= {"phase KV", "phase Q"}
                          for row in blocks), [(r.name, r.tier, r.phases) for r in blocks]
    for row in blocks:   # the parts add up to the predicted figure; phases peak within the call
        assert row.kv > 0 and row.inputs + row.kv + row.held + row.transient == row.predicted
        assert all(0 <= p.own <= row.own for p in row.phases)


@torch.no_grad()
def test_a_lone_blocks_measured_peak_is_measure_peaks(tmp_path):
    module, args, kwargs = _wan_block()
    handle = streamplan.apply(module, chunk_tokens=64, capture="prefer", kv="int8")
    try:
        _, peak = streamplan.measure_peak(lambda: module(*args, **kwargs))
        timeline = handle.timeline(tmp_path / "block.html")
    finally:
        handle.remove()
    (row,) = timeline.rows
    assert row.tier == "L5" and row.own == peak == timeline.call_own   # the call is the block's
    assert [p.name for p in row.phases] == ["phase KV", "phase Q"]
    _, _, calls, _, _ = _parse(tmp_path / "block.html")
    assert int(calls[0].get("data-own")) == peak


@torch.no_grad()
def test_an_unmetered_call_is_drawn_predicted_and_says_how_to_measure(tmp_path):
    module, args, kwargs = _wan_block()
    handle = streamplan.apply(module, chunk_tokens=64, capture="prefer")
    try:
        empty = handle.timeline()
        assert not empty.rows and "no streamed call recorded" in empty.notes[0]
        module(*args, **kwargs)
        timeline = handle.timeline(tmp_path / "t.html")
    finally:
        handle.remove()
    (row,) = timeline.rows
    assert row.own is None and row.predicted > row.inputs and timeline.call_own is None
    assert "streamplan.measure_peak" in timeline.notes[0]
    _, _, calls, whole, _ = _parse(tmp_path / "t.html")
    assert calls[0].get("data-measured") is None and whole.get("data-own") is None
    assert "streamplan.measure_peak" in (tmp_path / "t.html").read_text()


@torch.no_grad()
def test_the_ledger_costs_a_record_per_call_not_per_chunk():
    module, args, kwargs = _wan_block()
    seen = {}
    for chunk in (32, 256):
        handle = streamplan.apply(module, chunk_tokens=chunk, capture="prefer")
        try:
            module(*args, **kwargs)
            module(*args, **kwargs)          # the ledger is the last call's, started anew
            seen[chunk] = [(r.name, r.phases) for r in handle.calls]
            assert all(r.tag.startswith(RANGE_PREFIX) for r in handle.calls)
        finally:
            handle.remove()
    assert seen[32] == seen[256] == [("", ["phase KV", "phase Q"])]


def test_render_html_is_well_formed_for_several_sections():
    from streamplan.timeline import CallRow, PhaseRow, Timeline
    rows = [CallRow("a<b>&c", "X", 0, "L1", "L1 rows=8 chunk=4", 100, 10, 20, 30, 160, 400, 150,
                    phases=[PhaseRow("phase KV", 40), PhaseRow("phase Q", 150)])]
    page = render_html([Timeline("one", rows, 100, 150, 300), Timeline("two & more", rows, 100)])
    root = ET.fromstring(page)
    assert len(list(root.iter(f"{SVG}svg"))) == 2
    assert [g.get("data-name") for g in root.iter(f"{SVG}g") if g.get("class") == "call"] == ["a<b>&c"] * 2
