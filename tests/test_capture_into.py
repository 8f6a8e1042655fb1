"""A chunk's K, V and output are written by the ops that make them straight into their whole buffers (``out=``), not
copied there from chunk tensors of their own: bit for bit what the copies gave, the copies gone, and never where an
input the op overwrites is still to be read."""
import torch
from torch import nn

import streamplan
from conftest import OpCounter, rel_err
from streamplan.execute import graph_run as execute
from streamplan.execute.donation import donate

N = 1200


def _copies(elements: int) -> OpCounter:
    """Counts ``copy_`` calls of at least ``elements`` elements."""
    return OpCounter((torch.ops.aten.copy_.default,), lambda args: args[0].numel() >= elements)


def _h3():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    block = MiniMaxH3TransformerBlock(256, 8, 64, 512, 32, 1e-6, 1e-6).eval()
    return block, (torch.randn(1, N, 256), torch.randn(2, 32), torch.randint(0, 6, (N,)),
                   (torch.randn(N, 48), torch.randn(N, 48)))


def _streamed(block, args, monkeypatch, direct: bool, donated: bool = False):
    """Output and chunk-sized copies of one streamed call (three 400-row chunks), with or without the direct writes."""
    if not direct:
        monkeypatch.setattr(execute, "found", lambda *a, **k: None)
    handle = streamplan.apply(block, capture="prefer", chunk_tokens=400)
    x = args[0].clone()
    block(x, *args[1:])   # captured and planned
    counter = _copies(400 * 256)
    with counter:
        if donated:
            with donate(x):
                out = block(x, *args[1:])
        else:
            out = block(x.clone(), *args[1:])
    handle.remove()
    monkeypatch.undo()
    return out, counter.count, x


@torch.no_grad()
def test_k_v_and_output_are_written_into_their_buffers(monkeypatch):
    block, args = _h3()
    ref = block(*args)
    out, copies, _ = _streamed(block, args, monkeypatch, direct=True)
    old, old_copies, _ = _streamed(block, args, monkeypatch, direct=False)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out, old)
    # K (its rotary's cat), V (its projection) and the output (the last add) copied from the first chunk alone
    assert old_copies - copies == 3 * 2, (old_copies, copies)


@torch.no_grad()
def test_a_donated_input_is_written_by_the_last_add(monkeypatch):
    block, args = _h3()
    ref = block(*args)
    out, copies, x = _streamed(block, args, monkeypatch, direct=True, donated=True)
    assert out.data_ptr() == x.data_ptr() and rel_err(out, ref) <= 1e-5
    old, _, _ = _streamed(block, args, monkeypatch, direct=False, donated=True)
    assert torch.equal(out, old)


class _ReadsInputAfterOutput(nn.Module):
    """Its first output is made before a second one reads the input's rows again: written into a donated input, the
    first output would overwrite rows the second still reads."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        first = self.out(a) + 1.0
        second = x * 2.0
        return first, second


@torch.no_grad()
def test_no_direct_write_where_a_later_node_reads_the_donated_input():
    block = _ReadsInputAfterOutput().eval()
    x = torch.randn(1, 900, 64)
    ref = block(x)
    streamplan.apply(block, capture="prefer", chunk_tokens=300)
    y = x.clone()
    block(y.clone())
    with donate(y):
        first, second = block(y)
    assert rel_err(first, ref[0]) <= 1e-5 and torch.equal(second, ref[1])


@torch.no_grad()
def test_a_projection_with_a_bias_keeps_its_copy(monkeypatch):
    """``linear.out`` adds the bias after the product (two roundings); the op adds it in one: Wan's biased V
    projection is not written through it, and the streamed output is bit for bit the copying one."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    block = WanTransformerBlock(128, 256, 4, qk_norm="rms_norm_across_heads", cross_attn_norm=True).eval()
    block.to(torch.bfloat16)   # in fp32 the two roundings often agree; in bf16 they do not
    n = 1200
    args = tuple(torch.randn(*s, dtype=torch.bfloat16) for s in ((1, n, 128), (1, 8, 128), (1, 6, 128)))
    args += ((torch.randn(1, n, 1, 32), torch.randn(1, n, 1, 32)),)
    outs = []
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(execute, "found", lambda *a, **k: None)
        handle = streamplan.apply(block, capture="prefer", chunk_tokens=400)
        outs.append(block(*args))
        handle.remove()
        monkeypatch.undo()
    assert rel_err(outs[0], block(*args)) <= 2e-2   # bf16: chunked GEMMs round as they do
    assert torch.equal(outs[0], outs[1])


def test_nothing_of_a_streamed_call_outlives_it():
    """The first call captures the block: none of its runs (their K/V and output buffers) may survive it, with the cycle
    collector off (as it mostly is between GPU kernels). A trace that fails inside torch.export leaves cycles among
    its frames that reach that call's frame: ``capture`` collects them when a trace failed (torch 2.11's constraint
    retry, every eager GQA attention: a Gemma 2 layer's V held into the next layer on the H200, reproduced with torch
    2.11 on CPU); this H3 block traces at once, so this checks the rest: nothing else keeps a run)."""
    import gc
    block, args = _h3()
    streamplan.apply(block, capture="prefer", chunk_tokens=400)
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            block(*args)
        alive = sum(isinstance(o, execute.GraphRun) for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0
