"""``graph.work.block_work`` against torch's own FLOP count: ``FlopCounterMode`` over the stock forward of real library
blocks, fp32 on CPU, at the capture's row count and at twice it (one capture prices every row count)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from streamplan.graph import streamable  # noqa: E402
from streamplan.graph.work import block_work  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES as DIFFUSERS  # noqa: E402
from streamplan.tools.catalogue.transformers_cases import CASES as TRANSFORMERS  # noqa: E402

CPU = torch.device("cpu")
N = 300
aten = torch.ops.aten


def _cpu_sdpa(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _torch_flops(block, args, kwargs) -> int:
    """FlopCounterMode's total over the stock forward. On CPU SDPA runs as
    ``_scaled_dot_product_flash_attention_for_cpu``, which torch's table leaves out (it would count 0): it is given
    torch's own SDPA formula, which counts the full Nq x Nk square whether causal or not ("NB: We aren't accounting
    for causal attention here")."""
    cpu_sdpa = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}
    counter = FlopCounterMode(display=False, custom_mapping=cpu_sdpa)
    with torch.no_grad(), counter:
        block(*args, **kwargs)
    return counter.get_total_flops()


def _total(w, causal_full: bool) -> float:
    """The call's FLOPs from ``w``; ``causal_full``: a causal attention counted over the full square, as torch does."""
    return (w.gemm_flops_row * w.rows + w.gemm_flops_static + w.gemm_flops_const
            + w.attention_flops * (2 if causal_full else 1) + w.attention_flops_row * w.rows)


@pytest.mark.parametrize("name", ["wan", "flux_double", "flux_single", "llama", "qwen3_moe"])
def test_flops_match_torch_at_two_row_counts_from_one_capture(name):
    case = DIFFUSERS.get(name) or TRANSFORMERS[name]
    torch.manual_seed(0)
    block = case.build()
    if name == "qwen3_moe":   # the loop over the experts: torch counts its linears (not a grouped matmul's FLOPs)
        block.mlp.experts.config._experts_implementation = "eager"
    args, kwargs = case.inputs(N, CPU, torch.float32)
    found, _ = streamable(block, args, kwargs, N)
    assert not isinstance(found, str), found
    causal = any(a.causal for a in found.analysis.attentions)
    for rows in (N, 2 * N):
        w = block_work(found, rows)
        args, kwargs = case.inputs(rows, CPU, torch.float32)
        ref = _torch_flops(block, args, kwargs)
        assert ref > 0
        assert abs(_total(w, causal) - ref) <= 0.01 * ref, (name, rows, w, ref)
        if causal:   # the causal half is what the planner prices
            assert _total(w, False) < 0.99 * ref
    assert w.gemm_flops_row > 0 and w.attention_flops > 0 and w.bytes_row > 0 and w.weight_bytes > 0
    assert w.ops_kv > 0 and w.ops_q > 0
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    assert 0 < w.weight_bytes <= params
    if name == "flux_single":   # text rows joined to the image rows before its linears: recomputed by every chunk
        assert w.gemm_flops_static > 0
    if name == "flux_double":   # the text stream's linears, on the text rows alone: once per call
        assert w.gemm_flops_const > 0 and w.gemm_flops_static == 0
    if name == "wan":   # cross-attention to the text keys
        assert w.attention_flops_row > 0 and w.gemm_flops_const > 0
    if name == "qwen3_moe":   # the experts, one opaque op: the router and k experts' FLOPs, a loop's launches
        from streamplan.integrations.experts import GROUPED_LAUNCHES, LOOP_LAUNCHES
        assert w.ops_q >= block.mlp.experts.num_experts * LOOP_LAUNCHES + GROUPED_LAUNCHES


@pytest.mark.parametrize("name", ["wan", "llama"])
def test_a_block_with_an_mlp_counts_its_slice_ops(name):
    case = DIFFUSERS.get(name) or TRANSFORMERS[name]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(N, CPU, torch.float32)
    found, _ = streamable(block, args, kwargs, N)
    assert found.mlp_regions
    assert block_work(found, N).ops_mlp > len(found.mlp_regions)


@pytest.mark.parametrize("name", ["pixart", "t5_film_decoder"])
def test_hand_written_attention_is_counted_as_the_fused_op(name):
    """diffusers' classic processor (``baddbmm``, softmax, ``bmm``): one ``eager_attention`` in the graph, global for
    the self-attention, per query row for the cross-attention to the text."""
    from diffusers.models.attention_processor import Attention, AttnProcessor
    case = DIFFUSERS[name]
    torch.manual_seed(0)
    block = case.build()
    for m in block.modules():
        if isinstance(m, Attention):
            m.set_processor(AttnProcessor())
    args, kwargs = case.inputs(N, CPU, torch.float32)
    found, _ = streamable(block, args, kwargs, N)
    assert not isinstance(found, str), found
    for rows in (N, 2 * N):
        w = block_work(found, rows)
        args, kwargs = case.inputs(rows, CPU, torch.float32)
        ref = _torch_flops(block, args, kwargs)
        assert abs(_total(w, False) - ref) <= 0.01 * ref, (name, rows, w, ref)
    assert w.attention_flops > 0 and w.attention_flops_row > 0


class _ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 64), nn.Linear(32, 32)
        self.conv = nn.Conv1d(32, 32, 3, padding=1, groups=4)

    def forward(self, x):
        g, h = self.inp(x).chunk(2, dim=-1)
        return x + self.out(F.silu(g) * self.conv(h.transpose(1, 2)).transpose(1, 2))


def test_a_convolution_along_the_rows_is_counted():
    torch.manual_seed(0)
    block = _ConvBlock().eval()
    found, _ = streamable(block, (torch.randn(1, N, 32),), {}, N)
    assert not isinstance(found, str), found
    for rows in (N, 2 * N):
        w = block_work(found, rows)
        ref = _torch_flops(block, (torch.randn(1, rows, 32),), {})
        assert abs(_total(w, False) - ref) <= 0.01 * ref, (rows, w, ref)
    assert w.attention_flops == 0 and w.ops_kv == 0
