"""Merging partial attentions of the same query rows by their log-sum-exps: two into the second one's output
(``merge_into``: a causal chunk's past keys and diagonal block), or any number into an fp32 accumulator
(``LseAccumulator``).

``o2 <- o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``, ``lse = logaddexp(lse1, lse2)``, in fp32, rounded once. In
PyTorch that is a broadcast multiply and an ``addcmul`` per head group: broadcasting keeps them off PyTorch's vectorised
kernels, which makes the merge a visible share of a causal layer's attention time. On CUDA, where Triton is importable,
one kernel does it reading each element once and writing it once (6 bytes an element in bf16, against 14). Everywhere
else, and for layouts the kernel does not take, the PyTorch path runs. ``LseAccumulator.add`` likewise: one kernel a
block on CUDA where about ten PyTorch ops were (a K/V store's short blocks are bound by their launches). Both compute
the same formula in fp32; they can
differ by fp32 rounding before the one cast (a bf16 step at a rare tie), which is below any kernel-to-kernel difference
of the attention itself.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch._subclasses.fake_tensor import is_fake

logger = logging.getLogger(__name__)

MERGE_GROUPS = 4   # head groups the PyTorch path runs in (its fp32 copy: 4 bytes x heads/4 per row and head dim)


def merge_into(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """o1, o2 [B, H, c, D]; lse1, lse2 [B, H, c] fp32. Writes the merged attention into ``o2`` and returns it."""
    kernel = fused_kernel(o2.device.type)
    if kernel is not None and _kernel_takes(o1, lse1, o2, lse2):
        if is_fake(o2):   # a rehearsal: the kernel writes o2 in place and allocates nothing; it cannot run on fakes
            return o2
        return kernel(o1, lse1, o2, lse2)
    return merge_torch(o1, lse1, o2, lse2)


def merge_torch(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """The merge in PyTorch ops: a group of heads at a time (one fp32 copy of a quarter of the heads alive), two
    kernels a group."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp_().unsqueeze(-1), (lse2 - lse).exp_().unsqueeze(-1)
    step = max(1, o2.shape[1] // MERGE_GROUPS)
    for o1g, o2g, w1g, w2g in zip(o1.split(step, 1), o2.split(step, 1), w1.split(step, 1), w2.split(step, 1)):
        torch.addcmul(torch.mul(o1g, w1g), o2g, w2g, out=o2g)
    return o2


class LseAccumulator:
    """Any number of partial attention outputs of the same query rows merged by their log-sum-exps, in fp32 (K/V
    blocks of a store, key blocks of the soft-capped path): the accumulator and the log-sum-exps stay fp32 throughout,
    each block's output is widened as it is added, and the result is cast once at the end."""

    def __init__(self, q: torch.Tensor):
        B, H, c, D = q.shape
        self.acc = torch.zeros(B, H, c, D, dtype=torch.float32, device=q.device)
        self.lse = torch.full((B, H, c), float("-inf"), dtype=torch.float32, device=q.device)
        # looked up once, not once a block: a store's pass adds a block at a time, and on short blocks the host's
        # time per block is what the GPU waits on
        self.kernel = accumulate_kernel(q.device.type)
        self.fake = is_fake(self.acc)   # a rehearsal: the kernel writes in place and allocates nothing

    def add(self, o: torch.Tensor, lse: torch.Tensor, r0: int = 0, masked: bool = False) -> None:
        """Block output ``o`` of rows ``r0``.. with log-sum-exp ``lse``. ``masked``: rows may see no key of the block
        (-inf); they take nothing from it even where a kernel wrote NaN (decided without reading the device)."""
        acc, old = (self.acc, self.lse) if r0 == 0 else (self.acc[:, :, r0:], self.lse[:, :, r0:])
        if self.kernel is not None and _accumulator_takes(acc, old, o, lse):
            if not self.fake:
                self.kernel(acc, old, o, lse, masked)
            return
        accumulate_torch(acc, old, o, lse, masked)

    def result(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The merged output in ``dtype`` (into ``out`` when given)."""
        if out is not None:
            return out.copy_(self.acc)
        if dtype == torch.float32:
            return self.acc
        return self.acc.to(dtype)   # a block's output is not kept for this: it would sit beside the next block's


def accumulate_torch(acc: torch.Tensor, old: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, masked: bool) -> None:
    """``LseAccumulator.add`` in PyTorch ops: ``acc`` [B, H, c, D] and ``old`` [B, H, c] (fp32) updated in place."""
    lse = lse.float()
    new = torch.logaddexp(old, lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    a = torch.exp(old - safe).unsqueeze(-1)
    w = torch.exp(lse - safe).unsqueeze(-1)
    acc.mul_(a)
    acc.addcmul_(torch.where(w > 0, o, 0.0) if masked else o, w)
    old.copy_(new)


def _accumulator_takes(acc, old, o, lse) -> bool:
    """Any strides over batch, heads and rows; the head dim contiguous; fp32 accumulator and log-sum-exps."""
    return (o.dim() == 4 and o.shape == acc.shape and acc.dtype == torch.float32 and old.dtype == torch.float32
            and lse.dtype == torch.float32 and o.stride(-1) == acc.stride(-1) == 1
            and lse.shape == old.shape == acc.shape[:3] and acc.shape[-1] <= 512)


def accumulate_kernel(device_type: str | None):
    """The fused accumulator update for tensors on this device type, or None: CUDA with a Triton that builds."""
    return _cuda_accumulate() if device_type == "cuda" else None


@functools.lru_cache(maxsize=1)
def _cuda_accumulate():
    def probe(run):
        acc, lse = torch.zeros(1, 1, 2, 8, device="cuda"), torch.zeros(1, 1, 2, device="cuda")
        run(acc, lse.clone(), acc.clone(), lse, False)
    return _built_on_cuda(build_accumulate, probe, "accumulator")


def build_accumulate():
    """``LseAccumulator.add`` as one kernel (Triton's; on CPU tensors under ``TRITON_INTERPRET=1``, which is how the
    tests run it), or None where Triton is not installed: the same formula as ``accumulate_torch`` in fp32."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _accumulate(acc_ptr, old_ptr, o_ptr, l_ptr, rows, H, C,
                    sab, sah, sac, tab, tah, tac, sob, soh, soc, tlb, tlh, tlc,
                    MASKED: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = r < rows
        b, h, i = r // (H * C), (r // C) % H, r % C
        pold = old_ptr + b * tab + h * tah + i * tac
        old = tl.load(pold, mask=rmask, other=float("-inf"))
        lse = tl.load(l_ptr + b * tlb + h * tlh + i * tlc, mask=rmask, other=float("-inf"))
        hi = tl.maximum(old, lse)
        empty = hi == float("-inf")        # no key seen yet in either: nothing to take, the total stays -inf
        safe = tl.where(empty, 0.0, hi)
        new = safe + tl.log(tl.exp(old - safe) + tl.exp(lse - safe))
        new = tl.where(empty, float("-inf"), new)
        base = tl.where(empty, 0.0, new)
        a = tl.exp(old - base)
        w = tl.exp(lse - base)
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d[None, :] < D)
        pa = acc_ptr + (b * sab + h * sah + i * sac)[:, None] + d[None, :]
        po = o_ptr + (b * sob + h * soh + i * soc)[:, None] + d[None, :]
        x = tl.load(pa, mask=mask, other=0.0)
        y = tl.load(po, mask=mask, other=0.0).to(tl.float32)
        if MASKED:
            y = tl.where(w[:, None] > 0, y, 0.0)
        tl.store(pa, x * a[:, None] + y * w[:, None], mask=mask)
        tl.store(pold, new, mask=rmask)

    def run(acc, old, o, lse, masked):
        _launch(_accumulate, acc, acc, old, o, lse, MASKED=bool(masked),
                strides=(*acc.stride()[:3], *old.stride(), *o.stride()[:3], *lse.stride()))
        return acc

    return run


def merge_bytes_per_row(heads: int, head_dim: int, device_type: str | None) -> int:
    """What the merge allocates per query row besides its two inputs' outputs: the fused kernel nothing but the
    log-sum-exps it reads; the PyTorch path the combined log-sum-exp, two weights and one head group's fp32 copy."""
    if fused_kernel(device_type) is not None:
        return 8 * heads
    return 20 * heads + 4 * head_dim * max(1, heads // MERGE_GROUPS)


def _kernel_takes(o1, lse1, o2, lse2) -> bool:
    """Any strides over batch, heads and rows (cuDNN returns its output in Q's layout); the head dim contiguous."""
    return (o1.dim() == 4 and o1.shape == o2.shape and o1.dtype == o2.dtype and o1.stride(-1) == o2.stride(-1) == 1
            and lse1.shape == lse2.shape == o2.shape[:3] and lse1.dtype == lse2.dtype == torch.float32
            and o2.shape[-1] <= 512)


def fused_kernel(device_type: str | None):
    """The fused merge for tensors on this device type, or None: CUDA with a Triton that builds."""
    return _cuda_kernel() if device_type == "cuda" else None


@functools.lru_cache(maxsize=1)
def _cuda_kernel():
    def probe(run):
        x, lse = torch.zeros(1, 1, 2, 8, device="cuda", dtype=torch.bfloat16), torch.zeros(1, 1, 2, device="cuda")
        run(x, lse, x.clone(), lse)
    return _built_on_cuda(build_kernel, probe, "merge")


def _built_on_cuda(build, probe, what: str):
    """A Triton kernel (``build``'s) compiled once on a tiny problem (``probe``): None where Triton is not
    installed or cannot build here, so that the PyTorch path serves."""
    run = build()
    if run is None:
        return None
    try:
        probe(run)
    except Exception as exc:   # noqa: BLE001 - any failure to build means: the PyTorch path
        logger.info("streamplan: the fused log-sum-exp %s is unavailable (%s); PyTorch ops serve", what, exc)
        return None
    return run


def _launch(kernel, like: torch.Tensor, *args, **meta) -> None:
    """``kernel`` over the B x H x C rows of ``like`` [B, H, C, D], a block of rows by the whole head dim per program,
    on ``like``'s own GPU (Triton launches on the current one); the interpreter's CPU tensors as they are."""
    B, H, C, d = like.shape
    rows = B * H * C
    block_d = 1 << max(0, d - 1).bit_length()
    block_r = max(1, 4096 // block_d)
    # a device context only where ``like`` is on another GPU than the current one: it costs host time, once a block
    other = like.device.type == "cuda" and like.device.index != torch.cuda.current_device()
    with torch.cuda.device(like.device) if other else contextlib.nullcontext():
        kernel[(-(-rows // block_r),)](*args, rows, H, C, *meta.pop("strides"), **meta, D=d, BLOCK_R=block_r,
                                       BLOCK_D=block_d)


def build_kernel():
    """The fused merge as a callable (Triton's; on CPU tensors under ``TRITON_INTERPRET=1``, which is how the tests
    run it), or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _merge(o1_ptr, o2_ptr, l1_ptr, l2_ptr, rows, H, C,
               s1b, s1h, s1c, s2b, s2h, s2c, t1b, t1h, t1c, t2b, t2h, t2c,
               D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = r < rows
        b, h, i = r // (H * C), (r // C) % H, r % C
        l1 = tl.load(l1_ptr + b * t1b + h * t1h + i * t1c, mask=rmask, other=0.0)
        l2 = tl.load(l2_ptr + b * t2b + h * t2h + i * t2c, mask=rmask, other=0.0)
        hi = tl.maximum(l1, l2)
        lse = hi + tl.log(1.0 + tl.exp(tl.minimum(l1, l2) - hi))
        w1 = tl.exp(l1 - lse)
        w2 = tl.exp(l2 - lse)
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d[None, :] < D)
        p1 = o1_ptr + (b * s1b + h * s1h + i * s1c)[:, None] + d[None, :]
        p2 = o2_ptr + (b * s2b + h * s2h + i * s2c)[:, None] + d[None, :]
        x = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        tl.store(p2, (x * w1[:, None] + y * w2[:, None]).to(o2_ptr.dtype.element_ty), mask=mask)

    def run(o1, lse1, o2, lse2):
        _launch(_merge, o2, o1, o2, lse1, lse2, strides=(*o1.stride()[:3], *o2.stride()[:3], *lse1.stride(),
                                                          *lse2.stride()))
        return o2

    return run
