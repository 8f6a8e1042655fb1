"""Wan Animate 2's block on a generation step (``kv_cache_mode="cached"``, a flex ``BlockMask``): it keeps its stock
forward, named with why no captured graph can stand for it (``integrations.diffusers.flex.block_mask_refusal``), and
its self-attention streams as a part (and its cross-attention and MLP, which no recognizer knows, each from its own
captured graph), bit-exact against the real block's forward (fp32, CPU) and below its measured peak; other calls are
left to the capture as they were."""
import pytest
import torch

from conftest import streamed

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from streamplan.integrations.diffusers.flex import block_mask_refusal  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

CPU = torch.device("cpu")


def _block(rows: int):
    case = CASES["wan_animate2"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


@torch.no_grad()
def test_generation_step_keeps_the_block_stock_named_and_streams_its_parts_exactly():
    block, args, kwargs = _block(800)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
        report = handle.report()
        plans = handle.plans
    assert "ran stock: an argument of type BlockMask (its flex in-context mask) no captured graph can take" in report
    assert "the mask's 128-aligned layout" in report and "reads the grid's sizes off a tensor" in report, report
    assert plans["self_attn"][0].tier == "L1", report
    for part in ("cross_attn", "ffn"):   # no recognizer knows them: each streams from its own captured graph
        assert plans[part][0].tier == "L1" and plans[part][0].chunk == 128, report
    assert "captured torch.Sequential" in report and "captured diffusers.WanAnimate2Attention" in report, report
    assert torch.equal(out, ref)   # the parts' chunks: the same fp32 softmax per query row as the stock call's
    assert peak < stock, (peak, stock)


@torch.no_grad()
def test_the_reference_pass_is_left_to_the_capture_which_names_the_cache_it_fills():
    block, args, kwargs = _block(400)
    args = (*args[:4], "extract", *args[5:])   # the reference pass: it fills its cache, with no BlockMask
    kwargs = {**kwargs, "attention_mask": None}
    assert block_mask_refusal(block, args, kwargs) is None
    ref = block(*args, **kwargs)
    cache = args[3]
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        parts = {part: handle.plans[part][0].tier for part in ("cross_attn", "ffn")}
    assert "no captured graph can take" not in report, report
    assert "CacheWritten: the block sets WanAnimate2KVLayerCache.key (a cache being filled)" in report, report
    assert torch.equal(out, ref) and cache.key is not None
    assert set(parts.values()) == {"L1"}, report   # the block ran stock (a cache filled): its unknown parts streamed


def test_other_blocks_with_a_block_mask_are_not_claimed():
    block, args, kwargs = _block(400)
    assert block_mask_refusal(block, args, kwargs) is not None
    assert block_mask_refusal(torch.nn.Linear(4, 4), args, kwargs) is None
