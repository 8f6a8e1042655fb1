"""Per-row AdaLN lookups (MiniMax-H3's ``table.index_select(0, adaln_indices)``) over a chunk inside one run of equal
indices are that entry as one broadcast row: bit for bit the lookups' result, chunk-sized copies only where a chunk
crosses from one run into the next, the measured peak no higher."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import streamplan
from conftest import rel_err
from streamplan.capture import execute

N = 1200


class _Lookups(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.index_select.default
        return func(*args, **(kwargs or {}))


def _h3(index: torch.Tensor):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    block = MiniMaxH3TransformerBlock(256, 8, 64, 512, 32, 1e-6, 1e-6).eval()
    return block, (torch.randn(1, N, 256), torch.randn(2, 32), index, (torch.randn(N, 48), torch.randn(N, 48)))


def _run(block, args, monkeypatch, lookups: bool):
    if not lookups:
        monkeypatch.setattr(execute, "entry_row", lambda *a, **k: None)   # every lookup taken as stock takes it
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=100)
    block(*args)   # captured and planned
    counter = _Lookups()
    with counter:
        out, peak = streamplan.measure_peak(block, *args)
    handle.remove()
    monkeypatch.undo()
    return out, peak, counter.count


# text, audio, conditioning and noisy video rows, as the model packs them: (index, rows); 130 and 400 fall inside a
# 100-row chunk, 400 on a chunk's edge
PACKED = torch.cat([torch.full((130,), 4), torch.full((270,), 5), torch.full((800,), 3)])


@torch.no_grad()
def test_a_chunk_inside_one_run_takes_its_entry_as_one_row(monkeypatch):
    block, args = _h3(PACKED)
    ref = block(*args)
    out, peak, lookups = _run(block, args, monkeypatch, lookups=True)
    old, old_peak, old_lookups = _run(block, args, monkeypatch, lookups=False)
    assert torch.equal(out, old) and rel_err(out, ref) <= 1e-5
    # 12 chunks, 2 lookups in phase KV and 6 in phase Q each: only the chunk that crosses row 130 looks up
    assert old_lookups == 12 * 8 and lookups == 8, (old_lookups, lookups)
    assert peak <= old_peak, (peak, old_peak)   # the crossing chunk is as before: its peak is the call's


@torch.no_grad()
def test_scattered_indices_are_looked_up_as_stock_does(monkeypatch):
    block, args = _h3(torch.randint(0, 6, (N,)))
    ref = block(*args)
    out, _, lookups = _run(block, args, monkeypatch, lookups=True)
    assert rel_err(out, ref) <= 1e-5 and lookups == 12 * 8


@torch.no_grad()
def test_an_index_outside_the_table_fails_as_stock_does(monkeypatch):
    """Every row picks entry 6 of a 6-row table: no row is taken for it; index_select reports it."""
    block, args = _h3(torch.full((N,), 6))
    try:
        block(*args)
    except (IndexError, RuntimeError) as exc:
        stock_error = type(exc)
    streamplan.apply(block, capture="prefer", chunk_tokens=100)
    try:
        block(*args)
        raised = None
    except (IndexError, RuntimeError) as exc:
        raised = type(exc)
    assert raised is stock_error
