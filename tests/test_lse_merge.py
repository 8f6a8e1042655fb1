"""The causal chunk's log-sum-exp merge: the fused Triton kernel (CUDA's path) against the PyTorch ops (everywhere
else), run on CPU tensors under Triton's interpreter in a child process (``TRITON_INTERPRET`` must be set before
Triton is imported); and the merge against whole attention."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from streamplan.attention import lse_merge

CHILD = textwrap.dedent("""
    import torch
    from streamplan.attention import lse_merge
    run = lse_merge.build_kernel()
    g = torch.Generator().manual_seed(0)
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 4, 9, 16), (2, 3, 5, 24), (1, 8, 33, 128)):
            o1 = torch.randn(shape, generator=g).to(dtype)
            o2 = torch.randn(shape, generator=g).to(dtype)
            l1 = torch.randn(shape[:3], generator=g) * 6
            l2 = torch.randn(shape[:3], generator=g) * 6
            ref = lse_merge.merge_torch(o1, l1, o2.clone(), l2)
            # the second output in another layout (cuDNN returns Q's [B, c, H, D]), the log-sum-exps strided too
            o2t = o2.transpose(1, 2).contiguous().transpose(1, 2)
            l1t = l1.transpose(1, 2).contiguous().transpose(1, 2)
            for a, b, la in ((o1, o2.clone(), l1), (o1, o2t.clone(), l1t)):
                got = run(a, la, b, l2)
                assert got.data_ptr() == b.data_ptr()
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    print(worst)
    assert worst["torch.float32"] <= 1e-6, worst
    assert worst["torch.bfloat16"] <= 2 ** -7, worst   # one bf16 step at most, from fp32 rounding before the cast
""")


def test_fused_merge_kernel_matches_the_pytorch_merge():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


ACCUMULATE = textwrap.dedent("""
    import torch
    from streamplan.attention import lse_merge
    run = lse_merge.build_accumulate()
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 4, 9, 16), (2, 3, 5, 24), (1, 8, 33, 128)):
            for masked in (False, True):
                acc = torch.randn(shape, generator=g)
                old = torch.randn(shape[:3], generator=g) * 6
                old[..., 0] = float("-inf")                  # a row that has seen no key yet
                o = torch.randn(shape, generator=g).to(dtype)
                lse = torch.randn(shape[:3], generator=g) * 6
                if masked:                                   # rows that see no key of this block, NaN output
                    lse[..., 1:3] = float("-inf")
                    o[..., 1:3, :] = float("nan")
                lse[..., 0] = float("-inf")                  # no key in either: stays -inf, takes nothing
                ref_acc, ref_old = acc.clone(), old.clone()
                lse_merge.accumulate_torch(ref_acc, ref_old, o, lse, masked)
                # the block output in cuDNN's layout ([B, c, H, D] transposed) and the accumulator at a row offset
                ot = o.transpose(1, 2).contiguous().transpose(1, 2)
                big, big_old = torch.zeros(shape[0], shape[1], shape[2] + 3, shape[3]), torch.zeros(shape[:3] + (3,))
                big_old = torch.full((shape[0], shape[1], shape[2] + 3), 7.0)
                big[:, :, 3:] = acc
                big_old[:, :, 3:] = old
                for a, l_old, blk in ((acc.clone(), old.clone(), o), (big[:, :, 3:], big_old[:, :, 3:], ot)):
                    got = run(a, l_old, blk, lse, masked)
                    assert got.data_ptr() == a.data_ptr()
                    assert torch.equal(torch.isnan(a), torch.isnan(ref_acc)), masked
                    ok = ~torch.isnan(ref_acc)
                    err = ((a[ok] - ref_acc[ok]).abs().max() / ref_acc[ok].abs().max()).item()
                    lerr = (l_old - ref_old).abs()[torch.isfinite(ref_old)].max().item()
                    assert torch.equal(torch.isinf(l_old), torch.isinf(ref_old))
                    worst = max(worst, err, lerr)
                assert (big[:, :, :3] == 0).all() and (big_old[:, :, :3] == 7).all()   # rows before the offset
    print(worst)
    assert worst <= 1e-5, worst
""")


def test_fused_accumulator_kernel_matches_the_pytorch_accumulator():
    """``LseAccumulator.add``'s one CUDA kernel (a K/V store's blocks: ten launches a block before) against its
    PyTorch ops: rows that saw no key yet, masked rows whose block output is NaN, strided outputs, a row offset."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ACCUMULATE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kv_heads", [4, 1])
@torch.no_grad()
def test_causal_chunks_merged_match_whole_attention(kv_heads):
    """Chunks of causal query rows, each its past keys and its diagonal block merged (GQA heads as they are), against
    one causal call over all rows."""
    from streamplan.attention.sdpa import _causal_by_parts
    torch.manual_seed(0)
    q = torch.randn(1, 4, 96, 32)
    k, v = torch.randn(1, kv_heads, 96, 32), torch.randn(1, kv_heads, 96, 32)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // kv_heads, 1),
                                         v.repeat_interleave(4 // kv_heads, 1), is_causal=True)
    for a in (32, 64):
        got = _causal_by_parts(q[:, :, a:a + 32], k, v, a, None)
        assert got is not None
        assert rel_err(got, ref[:, :, a:a + 32]) <= 1e-5


def test_merge_memory_is_the_pytorch_paths_off_cuda():
    assert lse_merge.fused_kernel("cpu") is None
    assert lse_merge.merge_bytes_per_row(32, 128, "cpu") == 20 * 32 + 4 * 128 * 8


def test_a_rehearsal_never_launches_the_fused_kernel(monkeypatch):
    """A rehearsal runs the forward on fake tensors: a Triton launch on them reads no memory of theirs (on CUDA, an
    illegal access). The merge stands the kernel in: ``o2`` written in place, nothing allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    launched = []
    monkeypatch.setattr(lse_merge, "fused_kernel", lambda device_type: lambda *a: launched.append(a))
    with FakeTensorMode():
        o1, o2 = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
        lse1, lse2 = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
        assert lse_merge.merge_into(o1, lse1, o2, lse2) is o2
    assert launched == []
    lse_merge.merge_into(*(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8)) * 2)   # real tensors: the kernel runs
    assert len(launched) == 1
