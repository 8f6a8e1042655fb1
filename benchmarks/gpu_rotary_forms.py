"""H200: one rotary embedding (H3's: 96 of 128 channels, 56 heads) computed in exact forms that differ only in where
each pointwise op writes, timed alone at one chunk's rows. Why: PyTorch runs an elementwise op in its vectorized
kernel only where every operand is contiguous and none broadcast; a join slot (a strided slice) or a broadcast operand
drops it to the per-element kernel, 3-5x slower per byte. The forms say which writes are worth moving.

    python benchmarks/gpu_rotary_forms.py 16384
"""
from __future__ import annotations

import sys

import torch

from common import device_info, script_parser, write_results

BF16 = torch.bfloat16


def stock(x, cos, sin):   # diffusers' _apply_rotary_emb, as the model runs it
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


def _rotated_times_sin(xr, sin):   # cat((-x2, x1)) built in place, times sin over itself
    h = xr.shape[-1] // 2
    rot = torch.empty_like(xr)
    torch.neg(xr[..., h:], out=rot[..., :h])
    rot[..., h:].copy_(xr[..., :h])
    return torch.mul(rot, sin, out=rot)


def slots(x, cos, sin):   # joins built in place, every slot writing its strided slice (the engine today)
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    rot = _rotated_times_sin(xr, sin)
    out = torch.empty_like(x)
    torch.mul(xr, cos, out=out[..., :r])
    torch.add(out[..., :r], rot, out=out[..., :r])
    out[..., r:].copy_(xp)
    return out


def add_dense(x, cos, sin):   # the add (all operands dense) written over its dying operand, then copied in
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    rot = _rotated_times_sin(xr, sin)
    a = xr * cos
    torch.add(a, rot, out=a)
    out = torch.empty_like(x)
    out[..., :r].copy_(a)
    out[..., r:].copy_(xp)
    return out


def over_input(x, cos, sin):   # the joined value is x itself (it dies here): the passed channels never move
    xr = x[..., :cos.shape[-1]]
    rot = _rotated_times_sin(xr, sin)
    a = xr * cos
    torch.add(a, rot, out=a)
    xr.copy_(a)
    return x


def over_input_slot(x, cos, sin):   # as over_input, the add writing x's slice itself
    xr = x[..., :cos.shape[-1]]
    rot = _rotated_times_sin(xr, sin)
    torch.mul(xr, cos, out=xr)
    torch.add(xr, rot, out=xr)
    return x


def timed(fn, make, reps=20):
    times = []
    for _ in range(reps):
        x = make()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[reps // 2]


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("rows", nargs="?", type=int, default=16384, help="one chunk's rows (default: %(default)s)")
    n = p.parse_args().rows
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(n, 56, 128, device="cuda", dtype=BF16, generator=g)
    pos = torch.randn(n, 96, device="cuda", generator=g)
    cos, sin = pos.cos().to(BF16)[:, None, :], pos.sin().to(BF16)[:, None, :]
    make = lambda: base.clone()  # noqa: E731
    ref = stock(make(), cos, sin)
    forms = {"stock": stock, "slots": slots, "add_dense": add_dense, "over_input": over_input,
             "over_input_slot": over_input_slot}
    rows = []
    for name, f in forms.items():
        out = f(make(), cos, sin)
        same = bool(torch.equal(out, ref))
        ms = timed(lambda x: f(x, cos, sin), make)
        rows.append({"form": name, "bitwise_equal_to_stock": same, "ms": ms})
        print(rows[-1], flush=True)
    clone_ms = timed(lambda x: None, make)
    info = {**device_info(), "rows_per_chunk": n, "empty_call_ms": clone_ms, "forms": rows}
    try:   # an exact fused kernel: what the per-op forms leave on the table
        import torch._inductor.config as ic
        ic.emulate_precision_casts = True
        fused = torch.compile(stock, dynamic=False)
        out = fused(make(), cos, sin)
        info["inductor_emulated"] = {"bitwise_equal_to_stock": bool(torch.equal(out, ref)),
                                     "max_abs": float((out.float() - ref.float()).abs().max()),
                                     "ms": timed(lambda x: fused(x, cos, sin), make)}
        print(info["inductor_emulated"], flush=True)
    except Exception as exc:   # noqa: BLE001
        info["inductor_emulated"] = {"error": repr(exc)[:300]}
    print(write_results(f"gpu_rotary_forms_{n}", info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
