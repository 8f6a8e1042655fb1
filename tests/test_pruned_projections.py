"""A projection a phase reads only some output features of (FLUX.2's single block: one linear to Q, K, V and the
MLP's input) runs for those features alone, checked bit for bit on a first chunk. Against diffusers' own blocks, fp32
on CPU."""
import pytest
import torch

pytest.importorskip("diffusers")

from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.graph import pruned_projections  # noqa: E402
from streamplan.graph.pruned_projections import find_prunings  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402


def _case(name: str, rows: int = 300):
    case = CASES[name]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, torch.device("cpu"), torch.float32)
    return block, args, kwargs


def _prunings():
    """Every pruned projection of every capture made so far (the call's capture among them)."""
    import streamplan.graph as graph
    return [p for found in list(graph._CACHE.values())
            for key, value in getattr(getattr(found, "phases", None), "done", {}).items() if key[0] == "prunings"
            for p in value]


def _fresh_checks():
    for p in _prunings():
        p.checked.clear()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_phase_kv_runs_the_fused_projection_for_k_and_v_alone():
    block, args, kwargs = _case("flux2_single")
    found, _ = streamable(block, args, kwargs, 300)
    att = found.analysis.attentions[0]
    (p,) = find_prunings(found.phases.kv[0], {att.k, att.v}, found.analysis)
    width = p.linear.meta["val"].shape[-1]
    inner = block.attn.inner_dim if hasattr(block.attn, "inner_dim") else width // 7
    assert (p.lo, p.hi) == (inner, 3 * inner), (p.lo, p.hi, width)   # K's and V's columns of q | k | v | mlp
    assert sorted(p.leaves.values()) == [(inner, 2 * inner), (2 * inner, 3 * inner)]


def test_a_block_whose_projections_are_read_whole_prunes_nothing():
    block, args, kwargs = _case("wan")
    found, _ = streamable(block, args, kwargs, 300)
    for att, nodes in zip(found.analysis.attentions, found.phases.kv):
        assert find_prunings(nodes, {att.k, att.v}, found.analysis) == []


@torch.no_grad()
def test_flux2_single_streams_exactly_with_the_projection_pruned():
    block, args, kwargs = _case("flux2_single")
    ref = _first(block(*args, **kwargs))
    _fresh_checks()
    with streamed(block, chunk_tokens=64) as handle:
        out = _first(block(*args, **kwargs))
        report = handle.report()
    assert rel_err(out, ref) == 0.0
    checked = [v for p in _prunings() for v in p.checked.values()]
    assert checked and all(checked), checked   # the pruned projection ran, found equal to the whole one
    assert "ran whole" not in report, report


@torch.no_grad()
def test_a_projection_whose_features_alone_differ_runs_whole_and_says_so(monkeypatch):
    block, args, kwargs = _case("flux2_single")
    ref = _first(block(*args, **kwargs))
    _fresh_checks()
    monkeypatch.setattr(pruned_projections.torch, "equal", lambda a, b: False)   # as a kernel that differs would
    with streamed(block, chunk_tokens=64) as handle:
        out = _first(block(*args, **kwargs))
        report = handle.report()
    assert rel_err(out, ref) == 0.0
    assert "ran whole" in report, report
