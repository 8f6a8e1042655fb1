"""An attention whose output a later attention's K/V read (diffusers' ``BasicTransformerBlock`` with
``double_self_attention``: its second self-attention reads the first one's output): streamed, the later attention's
phase KV runs the earlier one over every chunk, and phase Q ran it again. Where a budget holds its output whole, phase
KV keeps it and phase Q reads its rows (``Plan.kept_outputs``): the attention runs once. Checked on the real diffusers
block against its own forward, by counting the attention's kernel calls, and with the meter; on meta tensors, what the
time model prices either way. (LTX-2's audio attention over the video rows, once such a case, is reduced over the
chunks instead: ``tests/test_reduced_attentions.py``.)"""
import pytest
import torch

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from conftest import OpCounter, rel_err, streamed  # noqa: E402
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.graph.phases import keepable_outputs, rerun_attentions  # noqa: E402
from streamplan.graph.work import block_work  # noqa: E402
from streamplan.plan.planner import Tier  # noqa: E402
from streamplan.tools.families import FAMILIES, on_meta  # noqa: E402

ROWS, CHUNK, DIM = 1024, 256, 64
FLASH = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,)


def _block():
    torch.manual_seed(0)
    block = BasicTransformerBlock(DIM, 4, DIM // 4, double_self_attention=True).eval()
    return block, (torch.randn(1, ROWS, DIM),), {}


def _run(block, args, kwargs, **options):
    with streamed(block, capture="prefer", **options) as handle:
        block(*args, **kwargs)   # the first call plans and captures
        with OpCounter(FLASH, lambda a: a[1].shape[-2] == ROWS) as calls:
            out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
        (plan,) = handle.plans[""]
        return out, peak, plan, calls.count, handle.report()


@torch.no_grad()
def test_the_output_kept_from_phase_kv_runs_the_attention_once_exactly_within_its_prediction():
    block, args, kwargs = _block()
    ref = block(*args, **kwargs)
    rerun_out, rerun_peak, rerun, rerun_calls, _ = _run(block, args, kwargs, budget=None, chunk_tokens=CHUNK)
    chunks = ROWS // rerun.chunk
    assert not rerun.kept_outputs
    # the first attention: in the second's phase KV, then in phase Q; the second: in phase Q
    assert rerun_calls == 3 * chunks, rerun_calls
    kept_bytes = ROWS * DIM * 4   # the first attention's output (4 heads x 16 features, fp32)
    budget = rerun.predicted_total + 4 * kept_bytes   # room for it whole, short of stock's
    out, peak, plan, calls, report = _run(block, args, kwargs, budget=budget)
    assert plan.kept_outputs and "kept_outputs" in report, report
    assert calls == 2 * (ROWS // plan.chunk + (ROWS % plan.chunk > 0)), (calls, plan.chunk)
    assert rel_err(out, ref) <= 1e-5 and rel_err(rerun_out, ref) <= 1e-5
    # the kept output is priced as it is held: the plan misses no more than the rerun one at the same chunk
    assert plan.chunk == rerun.chunk
    assert peak - plan.predicted_peak <= rerun_peak - rerun.predicted_peak + 4096, \
        (peak, plan.predicted_peak, rerun_peak, rerun.predicted_peak)
    assert peak >= rerun_peak + kept_bytes // 2   # and it is held: the measured peak grows by it
    assert plan.predicted_total <= budget


@torch.no_grad()
def test_fixed_chunks_keep_nothing_and_a_budget_short_of_the_kept_output_attends_again():
    """No byte budget asks for the least memory: nothing kept. A budget the kept output does not fit beside the
    work: the rerun plan, within it."""
    block, args, kwargs = _block()
    ref = block(*args, **kwargs)
    with pytest.raises(streamplan.BudgetError) as refused:
        _run(block, args, kwargs, budget=1)
    smallest = refused.value.smallest_bytes
    out, peak, plan, calls, report = _run(block, args, kwargs, budget=int(smallest * 1.02))
    assert not plan.kept_outputs, report
    assert calls == 3 * -(-ROWS // plan.chunk)
    assert rel_err(out, ref) <= 1e-5


def test_the_time_model_counts_the_rerun():
    """The first attention is run by the second's phase KV (its FLOPs counted again); Wan's block has no such
    attention, and LTX-2's audio attention over the video rows, reduced over the chunks, no longer runs its video
    self-attention twice."""
    block, args, kwargs = _block()
    found, _ = streamable(block, args, kwargs, ROWS)
    assert not isinstance(found, str), found
    first = rerun_attentions(found.analysis, found.phases)
    assert [a.node for a in first] == [found.analysis.attentions[0].node]
    assert keepable_outputs(found.analysis, found.phases) == first
    work = block_work(found, ROWS)
    assert 0.45 * work.attention_flops < work.attention_rerun_flops < 0.55 * work.attention_flops
    for name, rows in (("wan-14b-block", 32768), ("ltx2-block", 206040)):
        module, inputs = on_meta(FAMILIES[name], rows, torch.bfloat16)
        args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
        found, _ = streamable(module, args, kwargs, rows)
        assert rerun_attentions(found.analysis, found.phases) == [], name
        assert block_work(found, rows).attention_rerun_flops == 0.0


class _ThreeAttentions(torch.nn.Module):
    """A block whose first attention's output feeds both later attentions' K/V: the second attention's phase KV keeps
    it, the third's reads it back there (and phase Q too)."""

    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(3))
        self.out = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))

    def _attend(self, i: int, x: torch.Tensor, kv_from: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q = self.qkv[i](x)[..., :D]
        k, v = self.qkv[i](kv_from)[..., D:].chunk(2, -1)
        split = lambda t: t.view(B, N, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        o = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
        return self.out[i](o.transpose(1, 2).reshape(B, N, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._attend(0, x, x)
        h2 = h + self._attend(1, h, h)
        return h2 + self._attend(2, h2, h)


@torch.no_grad()
def test_an_output_kept_for_two_later_attentions_is_read_back_in_both_exactly():
    torch.manual_seed(0)
    block, rows = _ThreeAttentions().eval(), 4096
    x = torch.randn(1, rows, 32)
    ref = block(x)
    first = lambda args: args[1].shape[-2] == rows and args[0].shape[-2] < rows  # noqa: E731
    with streamed(block, capture="prefer", budget=None, chunk_tokens=256) as handle:
        block(x)
        (rerun,) = handle.plans[""]
    assert rerun.tier != Tier.L0 and not rerun.kept_outputs, handle.report()
    budget = rerun.predicted_total + 4 * rows * 32 * 4
    with streamed(block, capture="prefer", budget=budget) as handle:
        block(x)
        with OpCounter(FLASH, first) as calls:
            out = block(x)
        (plan,) = handle.plans[""]
    assert plan.kept_outputs, handle.report()
    # every attention is chunked: 3 x the chunks in phase Q and once more per chunk for each later attention's
    # phase KV that needs an earlier output computed (attention 2's K/V: attention 1; attention 3's: attention 1
    # read back, attention 2 not needed); kept, attention 1 is attended once per chunk, in phase KV of attention 2
    chunks = -(-rows // plan.chunk)
    assert calls.count == 3 * chunks, (calls.count, chunks)
    assert rel_err(out, ref) <= 1e-5
