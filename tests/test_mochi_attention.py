"""Mochi's joint attention (``integrations/diffusers/mochi.py``): the real diffusers ``MochiTransformerBlock`` (its
graph refused: the processor picks the valid text tokens with ``nonzero``) streams its attention as a part, the video
rows in chunks against every video row's K/V and the valid text's, bit-exact against the block's own forward (fp32,
CPU) with padded text masks, below its measured peak; what the binder does not follow stays stock, named."""
import pytest
import torch
from torch.utils import _pytree as pytree

from conftest import rel_err, streamed  # noqa: E402

import streamplan

pytest.importorskip("diffusers")
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

CHUNK = 64


def _mochi(rows: int, batch: int = 1, valid=((1, 0, 1, 1, 1, 0, 0),)):
    """The catalogue's tiny block and its inputs at ``rows`` video rows, ``batch`` elements (random text and timestep
    per element), each with its row of ``valid`` as the text mask."""
    case = CASES["mochi"]
    torch.manual_seed(0)
    block = case.build()
    (x, text, temb, _, rope), kwargs = case.inputs(rows, torch.device("cpu"), torch.float32)
    if batch > 1:
        x, text, temb = (torch.randn(batch, *t.shape[1:]) for t in (x, text, temb))
    mask = torch.tensor(valid, dtype=torch.bool).expand(batch, -1) if len(valid) == 1 else \
        torch.tensor(valid, dtype=torch.bool)
    return block, (x, text, temb, mask, rope), kwargs


class _Chunks:
    """The query rows of every attention the streamed part runs, answering with streamplan's own SDPA consumer."""

    def __init__(self, monkeypatch):
        from streamplan.attention.sdpa import SDPAConsumer
        self.rows, real = [], SDPAConsumer.attend

        def counted(consumer, q, k, v, **kw):
            self.rows.append((q.shape[-2], k.shape[-2]))
            return real(consumer, q, k, v, **kw)
        monkeypatch.setattr(SDPAConsumer, "attend", counted)


def _assert_exact(out, ref):
    leaves, ref_leaves = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(leaves) == len(ref_leaves) == 2
    for o, r in zip(leaves, ref_leaves):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert torch.equal(o, r), rel_err(o, r)   # the same kernels on the same rows as the processor's


@torch.no_grad()
@pytest.mark.parametrize("rows", [400, 1000])
def test_attention_streams_with_padded_text_exactly(rows, monkeypatch):
    block, args, kwargs = _mochi(rows)
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        plans = handle.plans["attn1"]
    assert "MochiAttention[valid text tokens joined]" in report, report
    assert plans[0].tier == "L1" and plans[0].chunk == CHUNK, report
    keys = rows + 4                                   # every video row and the 4 valid text tokens
    video = [(CHUNK, keys)] * (rows // CHUNK) + ([(rows % CHUNK, keys)] if rows % CHUNK else [])
    assert chunks.rows == video + [(4, keys)], chunks.rows   # the text queries attended once
    _assert_exact(out, ref)


@torch.no_grad()
def test_batch_with_equal_valid_lengths_at_different_positions_streams_exactly(monkeypatch):
    block, args, kwargs = _mochi(400, batch=2, valid=((1, 0, 1, 1, 1, 0, 0), (0, 1, 1, 0, 1, 0, 1)))
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out = block(*args, **kwargs)
        assert handle.plans["attn1"][0].tier == "L1", handle.report()
    assert len(chunks.rows) == 8 and all(k == 404 for _, k in chunks.rows), chunks.rows
    _assert_exact(out, ref)


@torch.no_grad()
def test_no_valid_text_streams_the_video_rows_alone_exactly(monkeypatch):
    block, args, kwargs = _mochi(400, valid=((0,) * 7,))
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out = block(*args, **kwargs)
        assert handle.plans["attn1"][0].tier == "L1", handle.report()
    assert chunks.rows == [(CHUNK, 400)] * 6 + [(16, 400)], chunks.rows
    _assert_exact(out, ref)


@torch.no_grad()
def test_batch_with_different_valid_lengths_stays_stock_named(monkeypatch):
    block, args, kwargs = _mochi(400, batch=2, valid=((1, 0, 1, 1, 1, 0, 0), (1, 1, 1, 1, 1, 1, 0)))
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "valid text lengths differ between batch elements ([4, 6])" in report, report
    assert chunks.rows == []
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


@torch.no_grad()
def test_streamed_peak_is_below_stock():
    block, args, kwargs = _mochi(4000)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
        assert handle.plans["attn1"][0].tier == "L1", handle.report()
    _assert_exact(out, ref)
    assert peak < 0.6 * stock, (peak, stock)   # measured 0.44x: K/V and the outputs, not every row's Q/K/V copies


class _OtherProcessor:
    """A processor streamplan does not follow: the Mochi one's work, under another class."""

    def __call__(self, *args, **kwargs):
        from diffusers.models.attention_processor import MochiAttnProcessor2_0
        return MochiAttnProcessor2_0()(*args, **kwargs)


@torch.no_grad()
def test_another_processor_stays_stock_named(monkeypatch):
    block, args, kwargs = _mochi(400)
    block.attn1.processor = _OtherProcessor()
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "its processor is _OtherProcessor, not the MochiAttnProcessor2_0 streamplan follows" in report, report
    assert chunks.rows == [] and "attn1" not in handle.plans
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


@torch.no_grad()
def test_changed_processor_source_stays_stock_named(monkeypatch):
    import streamplan.integrations.diffusers.mochi as mochi
    monkeypatch.setitem(mochi.FOLLOWED, "MochiAttnProcessor2_0.__call__", "0" * 16)
    block, args, kwargs = _mochi(400)
    with streamed(block, chunk_tokens=CHUNK) as handle:
        report = handle.report()
    assert "MochiAttnProcessor2_0.__call__ differ from the diffusers 0.42.1 source streamplan follows" in report, report
