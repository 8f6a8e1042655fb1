"""What a chunk computes in place: a rotary embedding's ``cat`` built by the ops that make its parts writing into
their slices (``capture/joins.py``), and elementwise ops written over an operand that dies with them
(``capture/reuse.py``): bit for bit the run without them, no ``cat`` left on a chunk, less memory, and never over a
value something else still reads."""
import pytest
import torch
from torch import nn

import streamplan
from conftest import OpCounter, rel_err
from streamplan.graph import phases, schedule
from test_capture_into import _h3 as _h3_block
from test_capture_tiers import _llama

N = 1200


def _cats(rows: int) -> OpCounter:
    """Counts ``cat`` calls (into a buffer or not) of inputs with ``rows`` rows or more."""
    return OpCounter((torch.ops.aten.cat.default, torch.ops.aten.cat.out),
                     lambda args: args[0][0].dim() > 1 and max(args[0][0].shape[:-1]) >= rows)


def _h3():
    block, args = _h3_block()
    return block, args, {}


def _streamed(make, monkeypatch, joins: bool, reuse: bool = True):
    block, args, kwargs = make()
    if not (joins and reuse):   # what runs in place is kept per capture: the executor's answer filtered
        real = schedule.in_place

        def filtered(*a):
            found_joins, found_reuse = real(*a)
            return (found_joins if joins else {}), (found_reuse if reuse else {})
        monkeypatch.setattr(schedule, "in_place", filtered)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    first(block(*args, **kwargs))   # captured and planned
    cats = _cats(400)
    with cats:
        out, peak = streamplan.measure_peak(lambda: first(block(*args, **kwargs)))
    handle.remove()
    monkeypatch.undo()
    return out, peak, cats.count, first(block(*args, **kwargs))


@pytest.mark.parametrize("make, rotary_cats", [(_h3, 4), (_llama, 2)], ids=["h3-partial-rotary", "llama-rotate-half"])
@torch.no_grad()
def test_rotary_joins_are_built_in_place(make, rotary_cats, monkeypatch):
    torch.manual_seed(0)
    out, peak, cats, ref = _streamed(make, monkeypatch, joins=True)
    torch.manual_seed(0)
    old, old_peak, old_cats, _ = _streamed(make, monkeypatch, joins=False)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out, old)
    # Q's and K's joins on every one of the three chunks (K's on phase KV's chunks) were cats; none are now
    assert old_cats == 3 * rotary_cats and cats == 0, (old_cats, cats)
    assert peak <= old_peak


@pytest.mark.parametrize("make", [_h3, _llama], ids=["h3", "llama"])
@torch.no_grad()
def test_ops_over_dying_operands_save_memory_bit_for_bit(make, monkeypatch):
    torch.manual_seed(0)
    out, peak, _, ref = _streamed(make, monkeypatch, joins=True)
    torch.manual_seed(0)
    old, old_peak, _, _ = _streamed(make, monkeypatch, joins=False, reuse=False)
    assert torch.equal(out, old) and rel_err(out, ref) <= 1e-5
    assert peak < 0.97 * old_peak, (peak, old_peak)


class _Attention(nn.Module):
    """Four heads of 16 over 64 features, as the test modules below shape their values around them."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def heads(self, x):
        return self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)

    def attend(self, q, k, v, x):
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)


class _OperandReadTwice(_Attention):
    """``scaled`` is read three times and ``shifted`` twice (once through a view): neither may be written over; the
    values read once may."""

    def forward(self, x):
        q, k, v = self.heads(x)
        scaled = self.out(self.attend(q, k, v, x)) * 3.0
        shifted = scaled + 1.0
        both = scaled * shifted
        return both * 2.0 + scaled, shifted.unsqueeze(0).squeeze(0) - scaled


def _applied(cls):
    """A test module, its input, its stock output, and the module streamed in 300-row chunks."""
    block = cls().eval()
    x = torch.randn(1, 900, 64)
    ref = block(x)
    return block, x, ref, streamplan.apply(block, capture="prefer", chunk_tokens=300)


def _in_place(block, x) -> list[tuple[dict, dict]]:
    """What each phase of the captured block computes in place, phase KV's first (K's join is theirs)."""
    from streamplan.graph import streamable
    found, _ = streamable(block, (x,), {}, x.shape[1])
    return [phases.in_place(nodes, found.analysis, found.phases, set())
            for nodes in [*found.phases.kv, found.phases.q]]


@torch.no_grad()
def test_no_op_writes_over_an_operand_still_read():
    block, x, ref, handle = _applied(_OperandReadTwice)
    out = block(x)
    assert handle.plans[""], handle.report()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    _, reuse = _in_place(block, x)[-1]
    # the out projection's result under ``scaled``, ``both`` under its double; the sums write into the outputs
    assert sorted((p.name, m.name) for p, m in reuse.items()) == [("mul", "linear_1"), ("mul_2", "mul_1")], reuse
    handle.remove()


class _PartReadTwice(_Attention):
    """A join's part that the block also reads after the join: written in place, a later write into the joined
    value would reach it; it is copied in instead."""

    def forward(self, x):
        q, k, v = self.heads(x)
        doubled = k * 2.0                                   # read by the join and after it
        halved = k * 0.5                                    # read by the join alone: a slot
        k = torch.cat([doubled[..., :8], halved[..., 8:] + 1.0], dim=-1)
        return self.out(self.attend(q, k, v, x)) + doubled.transpose(1, 2).reshape(x.shape)


@torch.no_grad()
def test_a_part_read_elsewhere_is_copied_in():
    block, x, ref, handle = _applied(_PartReadTwice)
    (found,) = {id(j): j for joins, _ in _in_place(block, x) for j in joins.values()}.values()
    assert [m.name for m in found.slots] == ["add"]   # the doubled part's slice is a view of a value read later
    assert rel_err(block(x), ref) <= 1e-5
    handle.remove()


@pytest.mark.parametrize("donated", [True, False])
@torch.no_grad()
def test_the_memory_model_prices_what_runs_in_place(donated):
    """The planner reads the same in-place decisions (``graph.phases.in_place``): its predicted peak is the measured one
    to within 5%, input donated (the model forward's way) or not (phase KV runs before the output buffer exists)."""
    from streamplan.execute.donation import donate
    block, args, _ = _h3()
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400)
    x = args[0].clone()

    def call():
        if not donated:
            return block(x, *args[1:])
        with donate(x):
            return block(x, *args[1:])
    call()
    x = args[0].clone()
    _, peak = streamplan.measure_peak(call)
    plan = handle.plans[""][-1]
    assert 0.95 * peak <= plan.predicted_peak <= 1.05 * peak, (plan.predicted_peak, peak)
    handle.remove()


class _StaticUpdatedFromEveryRow(torch.nn.Module):
    """Static rows (an audio stream beside the video rows) updated in place from an attention over every row: the
    update runs in every chunk, so it must not write into a value the call computes once."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o, self.f = (torch.nn.Linear(16, 16) for _ in range(5))

    def forward(self, x, a):
        a = a.clone()
        a.mul_(2.0)
        out = torch.nn.functional.scaled_dot_product_attention(self.q(a), self.k(x), self.v(x))
        a.add_(self.o(out))
        return self.f(x), a


@torch.no_grad()
def test_an_in_place_update_of_a_value_computed_once_from_every_row_stays_stock_named():
    from streamplan.graph import streamable
    torch.manual_seed(0)
    block = _StaticUpdatedFromEveryRow().eval()
    x, a = torch.randn(1, 300, 16), torch.randn(1, 5, 16)
    found, _ = streamable(block, (x, a), {}, 300)
    assert isinstance(found, str) and "add_ writes into a value computed once per call" in found, found
