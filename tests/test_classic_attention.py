"""Attention written as diffusers' classic ``AttnProcessor`` writes it (``get_attention_scores``: heads folded into the
batch, ``baddbmm`` over an ``empty`` base or the mask, softmax, ``bmm``), found in the graph as one attention: blocks
whose processors are the classic one stream, exactly, against their own forward."""
import pytest
import torch

pytest.importorskip("diffusers")

from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402



@pytest.mark.parametrize("name", ["pixart", "t5_film_decoder"])
@torch.no_grad()
def test_blocks_on_the_classic_processor_stream_exactly(name):
    from diffusers.models.attention_processor import Attention, AttnProcessor
    case = CASES[name]
    torch.manual_seed(0)
    block = case.build()
    for m in block.modules():
        if isinstance(m, Attention):
            m.set_processor(AttnProcessor())
    args, kwargs = case.inputs(400, torch.device("cpu"), torch.float32)
    ref = block(*args, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    with streamed(block, chunk_tokens=64, capture="prefer") as handle:
        out = block(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        streaming = [n for n, ps in handle.plans.items() if any(p.tier == "L1" for p in ps)]
        attention = [n for n, e in handle.installed.items()
                     if any("1 global attention(s)" in note for note in e.runtime_notes)]
        assert attention and set(attention) <= set(streaming), handle.report()
        assert rel_err(out, ref) <= 1e-5


@torch.no_grad()
def test_the_classic_processors_scores_are_one_attention_in_the_graph():
    from diffusers.models.attention_processor import AttnProcessor
    case = CASES["pixart"]
    torch.manual_seed(0)
    block = case.build()
    block.attn1.set_processor(AttnProcessor())
    args, kwargs = case.inputs(400, torch.device("cpu"), torch.float32)
    found, _ = streamable(block, args, kwargs, 400)
    assert not isinstance(found, str), found
    targets = {str(n.target) for n in found.captured.graph.nodes}
    assert "aten.baddbmm.default" not in targets and "streamplan.eager_attention.default" in targets
