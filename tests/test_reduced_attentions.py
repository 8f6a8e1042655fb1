"""An attention of fixed queries over the rows (LTX-2's audio queries against the video rows) reduced over phase Q's
chunks: each chunk attends the queries to its own rows' K/V and merges by log-sum-exp, what reads the output runs once
after (``graph/reduced_attentions.py``). Checked on the real diffusers block against its own forward, by the
attention kernel's calls (no call ever sees every row's keys, the video self-attention runs once per chunk), and with
the meter against the memory model; a block whose rows read such an output back keeps it a global attention."""
import pytest
import torch

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from conftest import OpCounter, rel_err, streamed  # noqa: E402
from streamplan.graph import streamable  # noqa: E402
from streamplan.graph.analyze import Rows  # noqa: E402
from streamplan.execute import graph_run  # noqa: E402
from streamplan.graph.phases import rerun_attentions  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

ROWS, AUDIO = 1024, 12
FLASH = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,)


def _ltx2():
    torch.manual_seed(0)
    block = CASES["ltx2"].build().eval()
    args, kwargs = CASES["ltx2"].inputs(ROWS, torch.device("cpu"), torch.float32)
    return block, args, kwargs


def test_ltx2_audio_attention_over_the_video_rows_is_reduced_and_nothing_runs_twice():
    block, args, kwargs = _ltx2()
    found, _ = streamable(block, args, kwargs, ROWS)
    assert not isinstance(found, str), found
    an, ph = found.analysis, found.phases
    (r,) = an.reduced
    assert r.q.meta["val"].shape[-2] == AUDIO and len(an.attentions) == 1   # the video self-attention alone
    assert r.node not in {n for p in ph.kv for n in p} and r.node in ph.q
    assert ph.tail and all(not isinstance(an.rows.get(n), Rows) for n in ph.tail)
    assert rerun_attentions(an, ph) == []


@torch.no_grad()
@pytest.mark.parametrize("chunk", [256, 100])
def test_ltx2_streams_exactly_with_the_audio_queries_seeing_one_chunk_of_keys_at_a_time(chunk, monkeypatch):
    block, args, kwargs = _ltx2()
    ref = block(*args, **kwargs)
    retries = []   # a chunk retried in halves after merging part of itself would merge its keys twice: none
    attempt = graph_run.attempt
    monkeypatch.setattr(graph_run, "attempt", lambda work, a, b, n: retries.append(n) or attempt(work, a, b, n))
    with streamed(block, capture="prefer", budget=None, chunk_tokens=chunk) as handle:
        block(*args, **kwargs)
        seen = []
        with OpCounter(FLASH, lambda a: seen.append((a[0].shape[-2], a[1].shape[-2])) or True):
            out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
        (plan,) = handle.plans[""]
        report = handle.report()
    assert "reduced over the chunks" in report, report
    assert retries and set(retries) == {0}, retries
    for got, want in zip(out, ref):
        assert rel_err(got, want) <= 1e-5
    chunks = -(-ROWS // plan.chunk)
    audio = [k for q, k in seen if q == AUDIO and k not in (AUDIO, 7)]   # the audio queries over the video keys
    video = [q for q, k in seen if k == ROWS]                            # the video self-attention, all keys
    assert len(audio) == chunks and max(audio) <= plan.chunk and sum(audio) == ROWS, audio
    assert len(video) == chunks and sum(video) == ROWS, video
    # the merge, the constants held and the tail are priced: the meter within 16 KB of the model (it missed ~85 KB
    # while every constant of the audio side was kept for the call)
    assert abs(peak - plan.predicted_peak) <= 16 << 10, (peak, plan.predicted_peak)


@torch.no_grad()
def test_ltx2_under_its_smallest_budget_holds_it_exactly():
    block, args, kwargs = _ltx2()
    ref = block(*args, **kwargs)
    with pytest.raises(streamplan.BudgetError) as refused:
        with streamed(block, capture="prefer", budget=1):
            block(*args, **kwargs)
    budget = refused.value.smallest_bytes
    with streamed(block, capture="prefer", budget=budget) as handle:
        block(*args, **kwargs)
        out, peak = streamplan.measure_peak(lambda: block(*args, **kwargs), device=torch.device("cpu"))
        (plan,) = handle.plans[""]
    assert plan.tier.value != "L0"
    assert peak <= plan.predicted_total <= budget, (peak, plan.predicted_total, budget)
    for got, want in zip(out, ref):
        assert rel_err(got, want) <= 1e-5


class _PooledBack(torch.nn.Module):
    """Fixed queries attend the rows, and their output is added back to every row: the rows read the reduced output,
    so the attention must stay global (its K/V whole, its output computed before the rows need it)."""

    def __init__(self, dim: int = 32, heads: int = 2, queries: int = 4):
        super().__init__()
        self.heads = heads
        self.latents = torch.nn.Parameter(torch.randn(1, queries, dim))
        self.q, self.kv, self.out = (torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 2 * dim),
                                     torch.nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        k, v = self.kv(x).chunk(2, -1)
        o = torch.nn.functional.scaled_dot_product_attention(split(self.q(self.latents)), split(k), split(v))
        pooled = self.out(o.transpose(1, 2).reshape(B, -1, D)).mean(1, keepdim=True)
        return x + pooled


@torch.no_grad()
def test_an_output_the_rows_read_back_keeps_its_attention_global_and_exact():
    torch.manual_seed(0)
    block, x = _PooledBack().eval(), torch.randn(1, 1000, 32)
    ref = block(x)
    found, _ = streamable(block, (x,), {}, 1000)
    assert not isinstance(found, str), found
    assert found.analysis.reduced == [] and len(found.analysis.attentions) == 1
    with streamed(block, capture="prefer", budget=None, chunk_tokens=128) as handle:
        block(x)
        out = block(x)
        assert handle.plans[""], handle.report()
    assert rel_err(out, ref) <= 1e-5
