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
