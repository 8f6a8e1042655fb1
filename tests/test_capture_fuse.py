"""Exact fused chains (``capture/fuse.py``): a captured block's chains of element-wise ops (rotary, AdaLN modulation,
gated residual) each compiled by Inductor into one kernel, checked bit for bit against their eager ops before use.
Inductor's CPU backend runs the same path here with ``fuse=True`` (by default only CUDA with Triton fuses, and only
chunks large enough to be worth a compiled call). The oracle is the real module's own forward; a chain whose compiled
form differs or does not compile runs eager, and the report says so."""
import pytest
import torch

import streamplan
from conftest import rel_err
from streamplan.graph import schedule
from streamplan.graph import fused_chains as fuse
from streamplan.execute.donation import donate
from test_capture_into import _h3 as _h3_block
from test_capture_tiers import _llama

FUSED = "chain(s) of element-wise ops each ran as one compiled kernel"


def _h3():
    block, args = _h3_block()
    return block, args, {}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run(block, args, kwargs, **options):
    """Output, peak and report of a streamed call at 400-row chunks (after one call that captures and compiles)."""
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400, **options)
    _first(block(*args, **kwargs))
    out, peak = streamplan.measure_peak(lambda: _first(block(*args, **kwargs)))
    report = handle.report()
    handle.remove()
    return out, peak, report


@pytest.mark.parametrize("make", [_h3, _llama], ids=["h3", "llama"])
@torch.no_grad()
def test_fused_chains_are_the_eager_run_bit_for_bit(make):
    block, args, kwargs = make()
    ref = _first(block(*args, **kwargs))
    eager, eager_peak, report = _run(block, args, kwargs, fuse=False)
    assert FUSED not in report
    fused, peak, report = _run(block, args, kwargs, fuse=True)
    assert FUSED in report, report
    assert torch.equal(fused, eager)
    assert rel_err(fused, ref) <= 1e-5
    # priced as eager runs the chains: the plan holds fused, and the kernels hold no intermediates of their own
    assert peak <= eager_peak * 1.02, (peak, eager_peak)
    assert torch.equal(_first(block(*args, **kwargs)), ref)   # removed: stock again, bit for bit


@torch.no_grad()
def test_fused_donated_block_writes_its_input():
    block, args, _ = _h3()
    ref = block(*args)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400, fuse=True)
    block(args[0].clone(), *args[1:])
    x = args[0].clone()
    with donate(x):
        out = block(x, *args[1:])
    handle.remove()
    assert out.data_ptr() == x.data_ptr()
    assert rel_err(out, ref) <= 1e-5


class _Wrong:
    """A compiled chain that answers otherwise than its eager ops (or does not run at all)."""

    def __init__(self, fn, raises: bool):
        self.fn, self.raises = fn, raises

    def __call__(self, *args):
        if self.raises:
            raise RuntimeError("no C++ compiler")
        outs = self.fn(*args)
        return (outs[0] + 1, *outs[1:])


@pytest.mark.parametrize("raises, why", [(False, "its compiled form differed from its eager ops"),
                                         (True, "not compiled (RuntimeError: no C++ compiler)")],
                         ids=["differs", "fails"])
@torch.no_grad()
def test_chain_that_does_not_hold_runs_eager_and_is_reported(raises, why, monkeypatch):
    monkeypatch.setattr(fuse, "_COMPILED", {})
    real = fuse._compiled

    def wrong(chain, device):
        c = real(chain, device)
        if not isinstance(c.fn, _Wrong):
            c.fn = _Wrong(c.fn, raises)
        return c
    monkeypatch.setattr(fuse, "_compiled", wrong)
    block, args, kwargs = _h3()
    ref = block(*args)
    eager, _, _ = _run(block, args, kwargs, fuse=False)
    out, _, report = _run(block, args, kwargs, fuse=True)
    assert torch.equal(out, eager)
    assert rel_err(out, ref) <= 1e-5
    assert FUSED not in report
    assert f"ran eager: {why}" in report, report


@torch.no_grad()
def test_by_default_only_chunks_worth_a_compiled_call_fuse(monkeypatch):
    monkeypatch.setattr(fuse, "available", lambda device: True)   # Inductor runs here too: as if CUDA with Triton
    block, args, kwargs = _h3()
    _, _, report = _run(block, args, kwargs)   # fuse=None: 400-row chunks of a 256-wide block are far too small
    assert FUSED not in report
    monkeypatch.setattr(schedule, "MIN_BYTES", 0)
    _, _, report = _run(block, args, kwargs)
    assert FUSED in report, report


def test_default_fuses_only_on_cuda_with_triton():
    assert not fuse.available(torch.device("cpu"))


def test_fuse_must_be_a_bool_or_none():
    block, _, _ = _h3()
    with pytest.raises(ValueError, match="fuse must be True, False or None"):
        streamplan.apply(block, capture="prefer", fuse="yes")


@torch.no_grad()
def test_fused_h3_model_end_to_end():
    from test_h3_model import _inputs, _model
    model, kw = _model(), _inputs()
    ref = model(**kw)
    outs = {}
    for fused in (False, True):
        handle = streamplan.apply(model, chunk_tokens=48, fuse=fused)
        model(**kw)
        outs[fused] = model(**kw)
        report = handle.report()
        handle.remove()
        assert (FUSED in report) == fused, report
    for name in ("sample", "audio_sample"):
        assert torch.equal(getattr(outs[True], name), getattr(outs[False], name))
        assert rel_err(getattr(outs[True], name), getattr(ref, name)) <= 1e-5
    again = model(**kw)
    assert torch.equal(again.sample, ref.sample) and torch.equal(again.audio_sample, ref.audio_sample)


@torch.no_grad()
def test_fused_chains_with_kv_staged_on_the_host():
    block, args, kwargs = _h3()
    ref = block(*args)
    eager, _, _ = _run(block, args, kwargs, fuse=False, kv="host")
    out, _, report = _run(block, args, kwargs, fuse=True, kv="host")
    assert "L4" in report and FUSED in report, report
    assert torch.equal(out, eager)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("case", ["flux_double", "hunyuan_video_double"])
@torch.no_grad()
def test_fused_chains_beside_static_rows(case):
    """Text rows joined to the image rows: the first chunk computes them, later chunks their dynamic rows alone; a
    chain holds dynamic rows only, so it is one computation in both."""
    from streamplan.tools.catalogue.diffusers_cases import CASES
    block = CASES[case].build()
    args, kwargs = CASES[case].inputs(400, torch.device("cpu"), torch.float32)
    ref = block(*args, **kwargs)
    outs = {}
    for fused in (False, True):
        handle = streamplan.apply(block, capture="prefer", chunk_tokens=64, fuse=fused)
        block(*args, **kwargs)
        outs[fused] = block(*args, **kwargs)
        report = handle.report()
        handle.remove()
        assert (FUSED in report) == fused, report
    for o, e, r in zip(outs[True], outs[False], ref):
        assert torch.equal(o, e)
        assert rel_err(o, r) <= 1e-5


@torch.no_grad()
def test_chains_run_eager_where_torch_compile_is_disabled(monkeypatch):
    monkeypatch.setattr(fuse, "_COMPILED", {})
    monkeypatch.setattr(fuse, "_dynamo_disabled", lambda: True)   # as TORCHDYNAMO_DISABLE=1 makes it
    block, args, kwargs = _h3()
    eager, _, _ = _run(block, args, kwargs, fuse=False)
    out, _, report = _run(block, args, kwargs, fuse=True)
    assert torch.equal(out, eager)
    assert FUSED not in report and "ran eager: torch.compile is disabled here" in report, report
