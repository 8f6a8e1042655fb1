"""H200: where a causal layer's chunked attention spends its time against stock's one call (issue 16).

Llama-3-8B's attention (32 query heads, 8 K/V heads, head dim 128, bf16) over N keys, the queries in C-row chunks,
each chunk against keys [0, offset + C). Variants, each summed over all chunks, CUDA-event timed:

- ``stock``: one ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` over all rows;
- ``streamplan``: the SDPA consumer's ``attend`` (the past keys and the causal diagonal block as two fused calls,
  merged by their log-sum-exps);
- ``parts_no_merge``: the same two fused calls without the merge, the diagonal block's K/V heads repeated and the
  past's query heads grouped as rows (what the merge costs is the difference); ``parts_native_gqa_*``: the same with
  the kernels given the 8 K/V heads as they are (the diagonal block; both parts);
- ``merge_torch`` / ``merge_fused``: the merge alone on one chunk's tensors (PyTorch ops; the fused kernel where
  Triton builds), times the chunk count (each with a copy of the output, ``clone_s``), and their difference;
- ``cudnn_gqa_*``: whether cuDNN takes 8 K/V heads for 32 query heads as they are (the diagonal block, causal; the
  past keys), against the same call with the K/V heads repeated;
- ``flash_lower_right`` / ``cudnn_causal`` / ``efficient_lower_right``: one call per chunk with the kernel's own
  causal flag on a chunk with fewer rows than keys (K/V heads not repeated), where the kernel takes it; each checked
  against stock's rows (lower-right alignment is what is needed: the flag's alignment differs between kernels).

    python benchmarks/gpu_causal_chunks.py 131072 3584,4224
Results: ``$OUT/gpu_causal_chunks_<N>.json``.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from common import cuda_time, device_info, int_list, rel_diff, script_parser, write_results
from streamplan.attention import lse_merge
from streamplan.attention import sdpa as S

H, HKV, D = 32, 8, 128


def _chunks(n: int, c: int):
    return [(a, min(c, n - a)) for a in range(0, n, c)]


def _single_calls(kind: str):
    """One call per chunk with the kernel's causal flag, K/V heads as they are; None where it refuses."""
    def call(q, k, v):
        if kind == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
        if kind == "cudnn":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False)[0]
        from torch.nn.attention.bias import causal_lower_right
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                                  enable_gqa=True)
    return call


def main(argv: list[str]) -> int:
    p = script_parser(__doc__)
    p.add_argument("tokens", nargs="?", type=int, default=131072,
                   help="N, the keys and query rows (default: %(default)s)")
    p.add_argument("chunks", nargs="?", type=int_list, default="3584,4224",
                   help="C, comma-separated query chunk sizes, one row of results each (default: %(default)s)")
    a = p.parse_args(argv[1:])
    n, sizes = a.tokens, a.chunks
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result = {**device_info(), "tokens": n, "heads": H, "kv_heads": HKV, "head_dim": D,
              "stock_choice": S._choice(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), True, None),
              "stock_s": cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
              "chunks": []}
    print(result, flush=True)
    consumer = S.SDPAConsumer(None)
    for c in sizes:
        chunks = _chunks(n, c)
        row = {"chunk": c, "chunks": len(chunks)}

        def streamed():
            return [consumer.attend(q[:, :, a:a + r], k, v, q_offset=a, causal=True, mask=None, scale=None)
                    for a, r in chunks]
        row["streamplan_s"] = cuda_time(streamed)
        outs = streamed()
        row["streamplan_rel"] = rel_diff(torch.cat(outs, 2), ref)
        del outs

        def parts():
            for a, r in chunks[1:]:
                qc = q[:, :, a:a + r]
                kd = k[..., a:a + r, :].repeat_interleave(4, 1)
                vd = v[..., a:a + r, :].repeat_interleave(4, 1)
                S._fused_with_lse(qc, kd, vd, True, None)
                S._fused_with_lse(S._grouped(qc, HKV), k[..., :a, :], v[..., :a, :], False, None)
        row["parts_no_merge_s"] = cuda_time(parts)

        def parts_native(group_past: bool):
            for a, r in chunks[1:]:
                qc = q[:, :, a:a + r]
                S._fused_with_lse(qc, k[..., a:a + r, :], v[..., a:a + r, :], True, None)
                S._fused_with_lse(S._grouped(qc, HKV) if group_past else qc, k[..., :a, :], v[..., :a, :], False,
                                  None)
        row["parts_native_gqa_diag_no_merge_s"] = cuda_time(lambda: parts_native(True))
        row["parts_native_gqa_both_no_merge_s"] = cuda_time(lambda: parts_native(False))
        mid, rows_mid = chunks[len(chunks) // 2]
        row["choice_gqa_diag"] = S._choice(q[:, :, mid:mid + rows_mid], k[..., mid:mid + rows_mid, :],
                                           v[..., mid:mid + rows_mid, :], True, None)
        row["choice_gqa_past"] = S._choice(q[:, :, mid:mid + rows_mid], k[..., :mid, :], v[..., :mid, :], False, None)
        o1 = torch.randn(1, H, c, D, device="cuda", dtype=torch.bfloat16)
        o2 = torch.randn_like(o1)
        l1, l2 = torch.randn(1, H, c, device="cuda") * 4, torch.randn(1, H, c, device="cuda") * 4
        row["merge_torch_s"] = cuda_time(lambda: lse_merge.merge_torch(o1, l1, o2.clone(), l2)) * (len(chunks) - 1)
        row["merge_fused_s"] = cuda_time(lambda: lse_merge.merge_into(o1, l1, o2.clone(), l2)) * (len(chunks) - 1)
        row["clone_s"] = cuda_time(lambda: o2.clone()) * (len(chunks) - 1)
        row["merge_fused_used"] = lse_merge.fused_kernel("cuda") is not None
        row["merge_fused_vs_torch_rel"] = rel_diff(lse_merge.merge_into(o1, l1, o2.clone(), l2),
                                                   lse_merge.merge_torch(o1, l1, o2.clone(), l2))
        t = o2.transpose(1, 2).contiguous().transpose(1, 2)   # cuDNN's output layout: Q's [B, c, H, D]
        row["merge_fused_strided_vs_torch_rel"] = rel_diff(lse_merge.merge_into(o1, l1, t.clone(), l2),
                                                           lse_merge.merge_torch(o1, l1, o2.clone(), l2))
        a, r = chunks[len(chunks) // 2]
        qc = q[:, :, a:a + r]
        for name, kk, vv, causal, want in (
                ("cudnn_gqa_diag", k[..., a:a + r, :], v[..., a:a + r, :], True, None),
                ("cudnn_gqa_past", k[..., :a, :], v[..., :a, :], False, None)):
            try:
                got = S._cudnn_with_lse(qc, kk, vv, causal, None)
                full = (kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1))
                ref_part = S._cudnn_with_lse(qc, *full, causal, None)
                row[name + "_rel"] = None if got is None else rel_diff(got[0], ref_part[0])
            except (RuntimeError, NotImplementedError) as e:
                row[name] = f"refused: {str(e).splitlines()[0][:200]}"
        for kind in ("flash", "cudnn", "efficient"):
            call = _single_calls(kind)
            name = {"flash": "flash_lower_right", "cudnn": "cudnn_causal", "efficient": "efficient_lower_right"}[kind]
            try:
                a, r = chunks[len(chunks) // 2]
                got = call(q[:, :, a:a + r], k[..., :a + r, :], v[..., :a + r, :])
                row[name + "_rel_mid_chunk"] = rel_diff(got, ref[:, :, a:a + r])
                row[name + "_s"] = cuda_time(lambda: [call(q[:, :, a:a + r], k[..., :a + r, :], v[..., :a + r, :])
                                                     for a, r in chunks])
            except (RuntimeError, NotImplementedError) as e:
                row[name] = f"refused: {str(e).splitlines()[0][:200]}"
        for key in [x for x in row if x.endswith("_s")]:
            row[key.replace("_s", "_vs_stock")] = row[key] / result["stock_s"]
        result["chunks"].append(row)
        print(row, flush=True)
        write_results(f"gpu_causal_chunks_{n}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
