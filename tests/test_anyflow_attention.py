"""AnyFlow FAR's causal self-attention on its cache-read step (``integrations/diffusers/anyflow.py``): the block's rows
streamed as Q chunks through the flex consumer against K/V laid out as the processor lays them out ([cached keys |
rows | zero rows padding the query length to 128]), exact against the real block's forward (fp32, CPU) and below its
measured peak; what the binder does not follow stays stock, named."""
import pytest
import torch

from conftest import rel_err, streamed

import streamplan

pytest.importorskip("diffusers")
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from streamplan.integrations.diffusers import anyflow  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES, _FAR_CACHED  # noqa: E402

CPU = torch.device("cpu")


def _anyflow_far(rows: int):
    case = CASES["anyflow_far"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


class _Chunks:
    """Records the flex consumer's chunks (query rows, keys each attends), answering with its own call."""

    def __init__(self, monkeypatch):
        import streamplan.attention.flex as flex
        self.calls, real = [], flex.flex_chunk

        def counted(q, k, *a, **kw):
            self.calls.append((q.shape[-2], k.shape[-2]))
            return real(q, k, *a, **kw)
        monkeypatch.setattr(flex, "flex_chunk", counted)


@torch.no_grad()
@pytest.mark.parametrize("rows", [300, 520])
def test_anyflow_far_read_step_streams_its_attention_exactly(rows, monkeypatch):
    block, args, kwargs = _anyflow_far(rows)
    ref = block(*args, **kwargs)
    chunks = _Chunks(monkeypatch)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        plans = handle.plans["attn1"]
    assert plans[0].tier == "L1" and plans[0].chunk == 128, report
    assert "AnyFlowAttention[flex, KV cache + zero padding]" in report, report
    keys = sum(_FAR_CACHED) + -(-rows // 128) * 128     # the cache, the rows, the zero rows padding them to 128
    assert chunks.calls == [(128, keys)] * (rows // 128) + [(rows % 128, keys)], chunks.calls
    assert rel_err(out, ref) <= 1e-6
    assert torch.equal(out, ref)   # the same fp32 softmax per query row, over the same keys in the same order



@torch.no_grad()
@pytest.mark.parametrize("cached", [False, True])
def test_narrow_heads_are_padded_as_the_processor_pads_them(cached):
    """Heads of 8 (the processor zero-pads them to 16 and keeps their own scale), with and without a cache."""
    from diffusers.models.transformers.transformer_anyflow_far import AnyFlowTransformerBlock
    torch.manual_seed(0)
    block = AnyFlowTransformerBlock(64, 128, 8, True, 1e-6, True).eval()
    rows, cache = 300, (10, 30) if cached else (0, 0)
    keys = sum(cache) + rows
    table = torch.polar(torch.ones(1, 1, keys, 4), torch.randn(1, 1, keys, 4)).to(torch.complex128)
    kv = {"compressed_cache": torch.randn(2, 1, 8, 20, 8), "full_cache": torch.randn(2, 1, 8, 40, 8)}
    flag = {"num_cached_chunks": 2, "is_cache_step": False, "num_cached_compressed_tokens": cache[0],
            "num_cached_full_tokens": cache[1]}
    args = (torch.randn(1, rows, 64), torch.randn(1, 7, 64), torch.randn(1, rows, 6, 64),
            {"query": table[:, :, -rows:], "key": table}, None, kv if cached else None, flag if cached else None)
    ref = block(*args)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args)
        plans = handle.plans["attn1"]
    assert plans[0].tier == "L1", handle.report()
    assert torch.equal(out, ref)

@torch.no_grad()
def test_anyflow_far_streamed_peak_is_below_stock():
    block, args, kwargs = _anyflow_far(1600)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=128):
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
    assert torch.equal(out, ref)
    assert peak < 0.2 * stock, (peak, stock)   # uncompiled flex's scores over every key: one chunk's, not all rows'


def _cache_write_step(args, kwargs):
    """The step that fills the cache with its rows' keys and values (128 rows: as many as the cache holds), the keys'
    rotary table the rows' own."""
    compressed, full = (args[5][name].shape[3] for name in ("compressed_cache", "full_cache"))
    flag = dict(args[6], is_cache_step=True, num_compressed_tokens=compressed, num_full_tokens=full)
    rotary = {"query": args[3]["query"], "key": args[3]["query"]}
    return args[:3] + (rotary,) + args[4:6] + (flag,), kwargs


def _block_mask(args, kwargs):
    rows = args[0].shape[1]
    keys = sum(_FAR_CACHED) + rows
    mask = create_block_mask(lambda b, h, q, kv: kv <= q + sum(_FAR_CACHED), None, None, -(-rows // 128) * 128,
                             keys + (-rows) % 128, device="cpu")
    return args[:4] + (mask,) + args[5:], kwargs


@torch.no_grad()
@pytest.mark.parametrize("change, why", [
    (_cache_write_step, "is_cache_step=True fills the KV cache"),
    (_block_mask, "its attention mask is a BlockMask"),
])
def test_calls_the_binder_does_not_follow_run_stock_named(change, why):
    block, args, kwargs = _anyflow_far(128)
    args, kwargs = change(args, kwargs)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert why in report, report
    assert torch.equal(out, ref)


def test_a_changed_processor_source_stays_stock_named(monkeypatch):
    monkeypatch.setitem(anyflow.FOLLOWED, "AnyFlowCausalAttnProcessor.__call__", "0" * 16)
    block, args, kwargs = _anyflow_far(300)
    with streamed(block, chunk_tokens=128) as handle:
        report = handle.report()
    assert "AnyFlowCausalAttnProcessor.__call__ differ from the diffusers 0.42.1 source" in report, report
    assert "attn1" not in handle.plans
