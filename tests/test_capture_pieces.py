"""Row-local runs of a captured block (norms, rotary, modulation between its GEMMs and attention) run a piece of the
chunk's rows at a time: exact against the real module, the measured peak lower than the same plan with the runs
whole, and the memory model pricing the pieces as they run."""
import pytest
import torch

import streamplan
from conftest import rel_err
from streamplan.graph import row_pieces as pieces

N = 1200


def _h3():
    """Attention wider than the residual, as the real model's (7168 against 5376): Q's norm and rotary are the chunk's
    worst moment once the MLP is sliced."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    block = MiniMaxH3TransformerBlock(256, 8, 64, 512, 32, 1e-6, 1e-6).eval()
    return block, (torch.randn(1, N, 256), torch.randn(2, 32), torch.randint(0, 6, (N,)),
                   (torch.randn(N, 16), torch.randn(N, 16))), {}


def _llama():
    """Its RMSNorms between the GEMMs, wide against its attention (the CPU flash kernel's tiles do not shrink)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    x = torch.randn(1, N, 1024)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(N)[None])
    return layer, (x,), {"position_embeddings": (cos, sin)}


@pytest.mark.parametrize("make, gain", [(_h3, 0.97), (_llama, 1.0)], ids=["h3-modulation-rotary", "llama-norms"])
@torch.no_grad()
def test_row_local_runs_in_pieces_are_exact_and_smaller(make, gain):
    """On CPU the flash kernel's tiles and the MLP exit (residual, its input and the accumulator: three rows of the
    residual's width, as many as an fp32 RMSNorm holds) bound these small blocks; the runs must not raise the peak
    anywhere, and lower it where the rotary is the worst moment (real-width figures: the meta-device planner)."""
    block, args, kwargs = make()
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    ref = first(block(*args, **kwargs))
    peaks = {}
    for cut in (False, True):   # without runs (the default): every node on the whole chunk
        handle = streamplan.apply(block, capture="prefer", chunk_tokens=400, ffn_slice=32,
                                  row_pieces=4 if cut else None)
        block(*args, **kwargs)   # captured and planned: the measured call runs the plan alone
        out, peaks[cut] = streamplan.measure_peak(lambda: first(block(*args, **kwargs)))
        (plan,) = handle.plans[""]
        handle.remove()
        assert rel_err(out, ref) <= 1e-5
        assert plan.predicted_peak >= 0.9 * peaks[cut], (plan.predicted_peak, peaks[cut])
    assert peaks[True] <= gain * peaks[False], peaks


@torch.no_grad()
def test_no_runs_where_the_graph_has_static_rows():
    """Text rows joined to the image rows are computed once per phase: their runs are left whole."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
    from streamplan.graph import streamable
    block = FluxSingleTransformerBlock(64, 4, 16).eval()
    args = (torch.randn(1, 300, 64), torch.randn(1, 20, 64), torch.randn(1, 64))
    kwargs = {"image_rotary_emb": (torch.randn(320, 16), torch.randn(320, 16))}
    found, _ = streamable(block, args, kwargs, 300)
    if isinstance(found, str) or not found.static_rows:
        pytest.skip(f"this diffusers' Flux single block does not capture with static rows: {found}")
    an = found.analysis
    assert pieces.find_runs(found.phases.q, an, set(an.outputs)) == []


@torch.no_grad()
def test_a_run_writes_its_output_into_a_dead_gemm_output(monkeypatch):
    """The rotary after Q's projection and the gated residual after the output projection write their results over
    the projection's rows (dead after the run, piece by piece): lower measured peak than with buffers of their own, the
    model knowing it, exact."""
    block, args, kwargs = _h3()
    ref = block(*args, **kwargs)
    peaks = {}
    for reuse in (False, True):
        if not reuse:
            monkeypatch.setattr(pieces, "_reuse", lambda *a: {})
        else:
            monkeypatch.undo()
        handle = streamplan.apply(block, capture="prefer", chunk_tokens=400, ffn_slice=32, row_pieces=4)
        block(*args, **kwargs)
        out, peaks[reuse] = streamplan.measure_peak(lambda: block(*args, **kwargs))
        (plan,) = handle.plans[""]
        handle.remove()
        assert rel_err(out, ref) <= 1e-5
        assert plan.predicted_peak >= 0.9 * peaks[reuse], (plan.predicted_peak, peaks[reuse])
    assert peaks[True] < peaks[False], peaks


def test_row_pieces_is_validated():
    block, args, kwargs = _h3()
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match="row_pieces must be a positive int"):
            streamplan.apply(block, row_pieces=bad)
