"""Values a block builds from the row count alone, built once per call over every row and read by the chunks as
inputs are (``Analysis.built_whole``): Qwen-Image's joint key mask, which its processor makes from the pipeline's
text mask and ones over the image rows, against the block's own forward."""
import pytest
import torch
from torch.utils import _pytree as pytree

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.graph.memory import graph_memory  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

N, CHUNK = 2048, 256


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_a_key_mask_built_inside_the_block_is_built_once_and_the_block_streams_near_its_floor():
    case = CASES["qwenimage_text_mask"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(N, torch.device("cpu"), torch.float32)
    ref, stock_peak = streamplan.measure_peak(lambda: block(*args, **kwargs))
    unmasked = block(args[0], args[1], None, *args[3:], **kwargs)
    assert _rel(unmasked[1], ref[1]) > 1e-4   # the padding tokens' mask changes the output: it is really applied

    found, _ = streamable(block, args, kwargs, N)
    assert len(found.analysis.built_whole) == 1, found.analysis.built_whole
    mask = next(iter(found.analysis.built_whole))
    assert found.analysis.attentions[0].mask is mask and mask in found.analysis.whole_inputs
    floor = graph_memory(found.analysis, found.phases, N, set()).kv_bytes + sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves(ref))

    handle = streamplan.apply(block, chunk_tokens=CHUNK)
    try:
        block(*args, **kwargs)   # the capture, outside the measurement
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs))
        assert all(p.tier == "L1" for p in handle.plans[""]), handle.report()
        assert "1 value(s) built from the row count once over every row" in handle.report(), handle.report()
        for o, r in zip(out, ref):
            assert _rel(o, r) <= 1e-5
        assert peak <= 1.6 * floor, (peak / floor, stock_peak / floor)
    finally:
        handle.remove()

