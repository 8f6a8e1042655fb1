"""What a chunk computes in place: a rotary embedding's ``cat`` built by the ops that make its parts writing into
their slices (``capture/joins.py``), and elementwise ops written over an operand that dies with them
(``capture/reuse.py``): bit for bit the run without them, no ``cat`` left on a chunk, less memory, and never over a
value something else still reads."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamplan
from conftest import rel_err
from streamplan.capture import execute

N = 1200


class _Cats(TorchDispatchMode):
    """Counts ``cat`` calls (into a buffer or not) of inputs with ``rows`` rows or more."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.count = rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0][0]
        if func in (torch.ops.aten.cat.default, torch.ops.aten.cat.out) and first.dim() > 1 \
                and max(first.shape[:-1]) >= self.rows:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _h3():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    block = MiniMaxH3TransformerBlock(256, 8, 64, 512, 32, 1e-6, 1e-6).eval()
    return block, (torch.randn(1, N, 256), torch.randn(2, 32), torch.randint(0, 6, (N,)),
                   (torch.randn(N, 48), torch.randn(N, 48))), {}


def _llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    x = torch.randn(1, N, 64)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(N)[None])
    return layer, (x,), {"position_embeddings": (cos, sin)}


def _streamed(make, monkeypatch, joins: bool, reuse: bool = True):
    block, args, kwargs = make()
    if not (joins and reuse):   # what runs in place is kept per capture: the executor's answer filtered
        real = execute.in_place

        def filtered(*a):
            found_joins, found_reuse = real(*a)
            return (found_joins if joins else {}), (found_reuse if reuse else {})
        monkeypatch.setattr(execute, "in_place", filtered)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    first(block(*args, **kwargs))   # captured and planned
    cats = _Cats(400)
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


class _OperandReadTwice(nn.Module):
    """``scaled`` is read three times and ``shifted`` twice (once through a view): neither may be written over; the
    values read once may."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        scaled = self.out(a) * 3.0
        shifted = scaled + 1.0
        both = scaled * shifted
        return both * 2.0 + scaled, shifted.unsqueeze(0).squeeze(0) - scaled


@torch.no_grad()
def test_no_op_writes_over_an_operand_still_read():
    block = _OperandReadTwice().eval()
    x = torch.randn(1, 900, 64)
    ref = block(x)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=300)
    out = block(x)
    assert handle.plans[""], handle.report()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    from streamplan.capture import streamable
    found, _ = streamable(block, (x,), {}, x.shape[1])
    _, reuse = execute.in_place(found.phases.q, found.analysis, found.phases, set())
    # the out projection's result under ``scaled``, ``both`` under its double; the sums write into the outputs
    assert sorted((p.name, m.name) for p, m in reuse.items()) == [("mul", "linear_1"), ("mul_2", "mul_1")], reuse
    handle.remove()


class _PartReadTwice(nn.Module):
    """A join's part that the block also reads after the join: written in place, a later write into the joined
    value would reach it; it is copied in instead."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
        doubled = k * 2.0                                   # read by the join and after it
        halved = k * 0.5                                    # read by the join alone: a slot
        k = torch.cat([doubled[..., :8], halved[..., 8:] + 1.0], dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return a + doubled.transpose(1, 2).reshape(x.shape)


@torch.no_grad()
def test_a_part_read_elsewhere_is_copied_in():
    block = _PartReadTwice().eval()
    x = torch.randn(1, 900, 64)
    ref = block(x)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=300)
    (found,) = [j for j in _joins(block, x)]
    assert [m.name for m in found.slots] == ["add"]   # the doubled part's slice is a view of a value read later
    assert rel_err(block(x), ref) <= 1e-5
    handle.remove()


def _joins(block, x):
    """The joins the captured block's phases (K's is phase KV's) build in place."""
    from streamplan.capture import streamable
    found, _ = streamable(block, (x,), {}, x.shape[1])
    joins = [j for nodes in [*found.phases.kv, found.phases.q]
             for j in execute.in_place(nodes, found.analysis, found.phases, set())[0].values()]
    return {id(j): j for j in joins}.values()


@pytest.mark.parametrize("donated", [True, False])
@torch.no_grad()
def test_the_memory_model_prices_what_runs_in_place(donated):
    """The planner reads the same in-place decisions (``execute.in_place``): its predicted peak is the measured one to
    within 5%, input donated (the model forward's way) or not (phase KV runs before the output buffer exists)."""
    from streamplan.executors.donation import donate
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
