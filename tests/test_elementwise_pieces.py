"""A per-row table read only in pieces (``table + temb.reshape(B, N, 6, D)``, then ``unbind``: LTX-2's modulation)
made one piece at a time where each is first read (``graph/elementwise_pieces.py``). Checked on the real diffusers
block against its own forward and with the meter against the same block captured without the rewrite; a piece a
matmul reads keeps its table whole."""
import pytest
import torch

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
import streamplan.graph as graph  # noqa: E402
from conftest import rel_err, streamed  # noqa: E402
from streamplan.graph.analyze import op_name  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

ROWS, CHUNK = 1024, 256


def _ltx2():
    torch.manual_seed(0)
    block = CASES["ltx2"].build().eval()
    args, kwargs = CASES["ltx2"].inputs(ROWS, torch.device("cpu"), torch.float32)
    return block, args, kwargs


def _split_tables(found) -> int:
    """Unbinds over the table dimension of an add (the modulation tables as stock holds them)."""
    return sum(1 for n in found.captured.graph.nodes if n.op == "call_function" and op_name(n.target) == "unbind"
               and op_name(getattr(n.args[0], "target", "")) == "add")


def _streamed_peak(block, args, kwargs):
    with streamed(block, capture="prefer", budget=None, chunk_tokens=CHUNK) as handle:
        block(*args, **kwargs)
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
        (plan,) = handle.plans[""]
    return out, peak, plan


@torch.no_grad()
def test_ltx2_tables_made_piece_by_piece_exactly_and_the_peak_falls(monkeypatch):
    block, args, kwargs = _ltx2()
    ref = block(*args, **kwargs)
    graph._CACHE.clear()
    found, _ = graph.streamable(block, args, kwargs, ROWS)
    assert _split_tables(found) == 0
    out, peak, plan = _streamed_peak(block, args, kwargs)
    assert rel_err(out[0], ref[0]) == 0.0 and rel_err(out[1], ref[1]) <= 1e-5
    assert abs(peak - plan.predicted_peak) <= 16 << 10, (peak, plan.predicted_peak)

    graph._CACHE.clear()   # the same block captured with its tables whole
    monkeypatch.setattr(graph, "split_read_in_pieces", lambda g: 0)
    found, _ = graph.streamable(block, args, kwargs, ROWS)
    assert _split_tables(found) >= 2   # the video's modulation and its cross-attention's scale/shift
    whole_out, whole_peak, whole_plan = _streamed_peak(block, args, kwargs)
    graph._CACHE.clear()
    assert whole_plan.chunk == plan.chunk
    # the tables: 6 + 4 + 1 rows of 64 fp32 features a row, whole, where a piece at a time holds fewer
    assert whole_peak - peak >= CHUNK * 64 * 4 * 6, (whole_peak, peak)


class _TableIntoMatmul(torch.nn.Module):
    """A per-row table whose second piece a linear layer reads: a matmul may take its operand's strides into account,
    so that table stays whole."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, 1, 2, dim))
        self.proj, self.qkv = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, inner = (self.table + temb.unflatten(-1, (2, -1))).unbind(2)
        q, k, v = self.qkv(x + shift).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return x + o + self.proj(inner)


@torch.no_grad()
def test_a_piece_a_matmul_reads_keeps_its_table_whole():
    torch.manual_seed(0)
    block, x, temb = _TableIntoMatmul().eval(), torch.randn(1, 600, 32), torch.randn(1, 600, 64)
    graph._CACHE.clear()
    found, _ = graph.streamable(block, (x, temb), {}, 600)
    assert not isinstance(found, str), found
    assert _split_tables(found) == 1
    ref = block(x, temb)
    with streamed(block, capture="prefer", budget=None, chunk_tokens=128) as handle:
        block(x, temb)
        out = block(x, temb)
        assert handle.plans[""], handle.report()
    assert rel_err(out, ref) <= 1e-6
