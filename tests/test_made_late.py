"""A chunk's values made as late as they may be (``phases.sunk``), dtype conversions written over (``in_place``), and in
blocks with static rows the values of dynamic rows alone written over too: each chunk holds fewer rows' worth of
values at its worst moment, and computes bit for bit what it did. Checked on diffusers' own Wan and HunyuanVideo
blocks (their forward the oracle) with the meter, against the same blocks with these rewrites turned off."""
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from streamplan.graph import in_place, phases  # noqa: E402

from conftest import diffusers_case, rel_err, streamed  # noqa: E402

CPU = torch.device("cpu")


def _leaves(x):
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _wan_wide(rows: int, dtype: torch.dtype):
    """diffusers' Wan block with heads of Wan's width (128), wide enough that a chunk's row-local values, not the CPU
    attention kernel's fixed tiles, make its worst moment; seeded random weights and inputs."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.manual_seed(0)
    module = WanTransformerBlock(512, 1024, 4, qk_norm=None, cross_attn_norm=True).eval()
    cos, sin = torch.randn(1, rows, 1, 128, dtype=dtype), torch.randn(1, rows, 1, 128, dtype=dtype)
    return module, (torch.randn(1, rows, 512, dtype=dtype), torch.randn(1, 64, 512, dtype=dtype),
                    torch.randn(1, 6, 512, dtype=dtype), (cos, sin)), {}


def _run(name: str, dtype: torch.dtype, rows: int, chunk: int):
    """The block's stock output, and streamed in fixed chunks: its output, measured peak and plan."""
    module, args, kwargs = _wan_wide(rows, dtype) if name == "wan-wide" else diffusers_case(name, rows, dtype)
    module = module.to(dtype)
    ref = _leaves(module(*args, **kwargs))
    with streamed(module, chunk_tokens=chunk, capture="prefer") as handle:
        module(*args, **kwargs)
        out, peak = streamplan.measure_peak(lambda: module(*args, **kwargs), device=CPU)
        (plan,) = handle.plans[""]
    return ref, _leaves(out), peak, plan


def _rewrites_off(monkeypatch) -> None:
    """Phases in graph order, no conversion written over, nothing in place where the block has static rows (as before
    these rewrites); captures made afresh."""
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
    monkeypatch.setattr(phases, "sunk", lambda nodes, an: list(nodes))
    monkeypatch.setattr(in_place, "_converted", lambda n: False)
    real = phases.find_reuse
    monkeypatch.setattr(phases, "find_reuse",
                        lambda nodes, an, keep, avoid: {} if an.static_rows else real(nodes, an, keep, avoid))


# HunyuanVideo's double block (text joined to the image rows) wrote nothing in place; Wan's (bf16: in fp32 its
# conversions are the values themselves) converts its residual late, and on the CPU its RMSNorms' own float32 copies
# are its worst moment (the memory model prices them: without, this block measured 17% over its plan)
@pytest.mark.parametrize("name, dtype, rows, chunk, tol, least_saved", [
    ("wan-wide", torch.bfloat16, 2048, 512, 1e-2, 0.0), ("hunyuan_video_double", torch.float32, 2048, 256, 1e-5, 0.0)])
@torch.no_grad()
def test_a_chunk_holds_no_more_and_computes_the_same(name, dtype, rows, chunk, tol, least_saved, monkeypatch):
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
    ref, out, peak, plan = _run(name, dtype, rows, chunk)
    _rewrites_off(monkeypatch)
    _, old, old_peak, old_plan = _run(name, dtype, rows, chunk)
    for o, r, b in zip(out, ref, old):
        assert rel_err(o, r) <= tol
        assert torch.equal(o, b)
    assert peak <= plan.predicted_peak * 1.001, (peak, plan.predicted_peak)
    assert peak >= plan.predicted_peak * 0.95, (peak, plan.predicted_peak)
    # the whole buffers (K, V, outputs) are the same: what a chunk holds is what changed
    transient, old_transient = plan.parts.transient, old_plan.parts.transient
    assert (plan.parts.kv, plan.parts.held) == (old_plan.parts.kv, old_plan.parts.held)
    assert transient <= (1 - least_saved) * old_transient, (transient, old_transient)
    assert peak <= old_peak, (peak, old_peak)


def test_wan_14b_phase_q_holds_less_at_its_worst(monkeypatch):
    """At Wan2.1-14B's width on meta tensors (the planning device): phase Q's worst moment was the gated residual's
    four float32 rows and two bf16 ones (70 KiB a row; 80 with the rotary buffer its ``copy_`` results held, let go
    now in both runs); made late and written over, 50 KiB, and 1.15x the floor at 32,768 rows takes 2,048-row chunks
    on the card where it took fewer rows or a host store."""
    from streamplan.plan import planner
    from streamplan.tools.families import FAMILIES, on_meta
    fam = FAMILIES["wan-14b-block"]
    per_row, chunks = [], []
    for off in (False, True):
        monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
        if off:
            _rewrites_off(monkeypatch)
        module, inputs = on_meta(fam, 32768, torch.bfloat16)
        budget = int(sum(t.numel() * t.element_size() for t in _leaves(inputs))
                     + 1.15 * fam.floor_bytes_per_token(torch.bfloat16) * 32768)
        seen = []
        real = planner._candidates
        monkeypatch.setattr(planner, "_candidates", lambda r, f: seen.append(r) or real(r, f))
        with streamed(module, capture="prefer", budget=budget) as handle, torch.inference_mode():
            module(*inputs)
            (plan,) = handle.plans[""]
        monkeypatch.setattr(planner, "_candidates", real)
        per_row.append(seen[0].transient(1024, 0) / 1024)
        chunks.append(plan.chunk if plan.kv == "device" else 0)
    assert per_row == [51200.0, 71680.0], per_row
    assert chunks[0] >= 2048 > chunks[1], chunks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
def test_a_cpu_rms_norm_costs_what_the_model_counts(dtype, weighted):
    """The float32 copies a CPU RMSNorm makes inside its call, measured by the meter, as ``cpu_norm_copies`` counts
    them (in its results' worth)."""
    from streamplan.graph import memory
    rows, width = 512, 768
    x, w = torch.randn(rows, width, dtype=dtype), torch.randn(width, dtype=dtype) if weighted else None
    if weighted:
        gm = torch.fx.symbolic_trace(lambda x, w: torch.ops.aten.rms_norm.default(x, [width], w, 1e-6))
    else:
        gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.rms_norm.default(x, [width], None, 1e-6))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["val"] = torch.empty(rows, width, dtype=dtype)
    out, peak = streamplan.measure_peak(lambda: torch.rms_norm(x, (width,), w, 1e-6), device=CPU)
    result = out.numel() * out.element_size()
    assert peak - result == pytest.approx(memory.cpu_norm_copies(node) * result, rel=0.01, abs=8192), (peak, result)


@torch.no_grad()
def test_static_rows_blocks_write_over_values_of_dynamic_rows_alone(monkeypatch):
    """HunyuanVideo's double block joins text rows to the image rows: its image stream's values are written over (the
    MLP's activation over its first projection among them), nothing with static rows."""
    from streamplan.graph.row_pieces import dynamic_rows
    from torch import fx
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
    found = _q_phase("hunyuan_video_double")
    an, ph = found.analysis, found.phases
    assert an.static_rows
    outputs = {o for o in an.outputs if isinstance(o, fx.Node)}
    joins, reuse = phases.in_place(ph.q, an, ph, outputs)
    assert not joins and reuse, reuse
    assert all(dynamic_rows(an.rows.get(p)) and dynamic_rows(an.rows.get(m)) for p, m in reuse.items()), reuse
    assert any(p.target == torch.ops.aten.gelu.default for p in reuse), reuse


def _q_phase(name: str):
    from streamplan.graph import streamable
    module, args, kwargs = diffusers_case(name, 512)
    found, _ = streamable(module, args, kwargs, 512)
    return found


@torch.no_grad()
def test_a_value_is_made_late_only_where_nothing_lives_longer(monkeypatch):
    """In Wan's phase Q every value moved is made right before its first reader, and each value it reads is read
    there or later anyway; the order is otherwise the graph's."""
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
    found = _q_phase("wan")
    an, q = found.analysis, found.phases.q
    graph_order = {n: i for i, n in enumerate(n for n in q[0].graph.nodes)}
    pos = {n: i for i, n in enumerate(q)}
    moved = [n for i, n in enumerate(q) if i and graph_order[n] < graph_order[q[i - 1]]]
    assert moved, "nothing made late in Wan's phase Q"
    for n in moved:
        first = min(pos[u] for u in n.users if u in pos)
        assert first == pos[n] + 1, n
        for m in n.all_input_nodes:
            if isinstance(m.meta.get("val"), torch.Tensor) and m.op != "get_attr" and m not in an.const:
                assert any(u is not n and pos.get(u, -1) > pos[n] for u in m.users), (n, m)
    assert sorted(pos) == sorted(q) and len(q) == len(set(q))
