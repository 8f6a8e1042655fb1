"""diffusers attention whose flex ``BlockMask`` is chosen from the call's own Q and K (NABLA: block means of Q and
K, a softmax over them, a cumulative threshold, OR a static prior): Kandinsky 6 SR's self-attention, streamed as an
attention part through the flex consumer.

The mask is a threshold on float sums, so a chunk cannot choose its own blocks from a sub-matrix. It is built once per
call, whole, by the library's own ``nabla_block_mask`` on tensors with the values the processor gives it: every row's
rotated K (the K/V phase's buffer) and Q, computed chunk by chunk beside K and dropped once the mask exists (so whole
Q lives only as long as the mask's build, with K and V). Each Q chunk, its rows' Q again by the module's own layers,
then attends every key under the mask cut to its query blocks (``attention.flex``). Follows diffusers 0.42.1's
processor, checked by the source fingerprints below.
"""
from __future__ import annotations

import contextlib
import numbers
import sys
from typing import Iterator

import torch
from torch import nn

from ...attention.flex import FlexMask, Q_BLOCK, block_mask_problem, full_block_tables
from ...recognize.checks import source_fingerprint
from ...registries import register_backend_probe, register_capture_context, register_row_contraction_op
from .followed import followed_spec, processor_call, unfollowed
from ...specs import AttentionCall, AttentionSpec, KVFrame, Segment, Skip

_MODULE = "diffusers.models.transformers.transformer_kandinsky6_sr"
# source fingerprints (checks.source_fingerprint) of what the binder follows, as in diffusers 0.42.1
FOLLOWED = {"Kandinsky6SRAttnProcessor.__call__": "a44e735e79b4d23c", "nabla_block_mask": "6211faef04c7bcfc",
            "apply_rotary": "15d7eed74767db3a"}
_ARGS = ("hidden_states", "rotary_emb", "sparse_params")
_SPARSE_KEYS = {"sta_mask", "threshold"}
_MASK_BLOCK = 64   # nabla_block_mask's default block_size, the one the processor uses


def _sources(mod) -> dict:
    """The sources the binder follows, by the names ``FOLLOWED`` records them under."""
    return {"Kandinsky6SRAttnProcessor.__call__": mod.Kandinsky6SRAttnProcessor.__call__,
             "nabla_block_mask": mod.nabla_block_mask, "apply_rotary": mod.apply_rotary}


def _bind_nabla(attn, mod, args: tuple, kwargs: dict) -> AttentionCall | str:
    call = processor_call(_ARGS, attn.processor, args, kwargs)
    if isinstance(call, str):
        return call
    x, rope, sparse = call.get("hidden_states"), call.get("rotary_emb"), call.get("sparse_params")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "hidden_states is not [batch, tokens, dim]"
    B, N, _ = x.shape
    if N % _MASK_BLOCK:
        return f"its {N} rows are not whole {_MASK_BLOCK}-row NABLA blocks"
    if not isinstance(sparse, dict) or set(sparse) != _SPARSE_KEYS or \
            not isinstance(sparse["sta_mask"], torch.Tensor) or not isinstance(sparse["threshold"], numbers.Real):
        return "sparse_params is not {'sta_mask': tensor, 'threshold': number}"
    if not isinstance(rope, torch.Tensor) or rope.dim() != 5 or rope.shape[0] != N:
        return "rotary_emb is not a [rows, 1, D/2, 2, 2] table"
    if Q_BLOCK % _MASK_BLOCK:
        return f"NABLA's {_MASK_BLOCK}-row blocks do not divide the chunk alignment ({Q_BLOCK})"
    H = attn.num_heads
    D = attn.to_query.out_features // H
    built: dict[str, torch.Tensor | FlexMask] = {}

    def q(h, a, b):
        query = attn.to_query(h).unflatten(-1, (H, -1))
        query = attn.query_norm(query.float()).type_as(query)
        return mod.apply_rotary(query, rope[a:b])

    def kv(h, a, b):
        key = attn.to_key(h).unflatten(-1, (H, -1))
        value = attn.to_value(h).unflatten(-1, (H, -1))
        key = attn.key_norm(key.float()).type_as(key)
        query = q(h, a, b)   # every row's Q, for the mask's block means
        if "q" not in built:
            built["q"] = query.new_empty((B, N, H, D))
        built["q"][:, a:b] = query
        return mod.apply_rotary(key, rope[a:b]), value

    def fill(k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """The call's mask, from the same Q and K values the processor passes its builder; whole Q dropped."""
        query = built.pop("q")
        mask = mod.nabla_block_mask(query.transpose(1, 2), k_buf.transpose(1, 2), sparse["sta_mask"],
                                    thr=sparse["threshold"])
        del query
        why = block_mask_problem(mask, q_len=N, kv_len=N, q_align=Q_BLOCK)
        if why:   # the checks above admit only masks a chunk can take: a library change that breaks that is an error
            raise RuntimeError(f"NABLA mask cannot be cut to chunks: {why}")
        built["mask"] = FlexMask(mask)

    def out(o, a, b):
        return attn.out_layer(o.flatten(2, 3))

    e, blocks = x.element_size(), B * H * (N // _MASK_BLOCK) ** 2
    return AttentionCall(batch=B, heads=H, kv_heads=H, head_dim=D, segments=[Segment(x, q, kv, out)],
                         finish=lambda outs: outs[0], dtype=x.dtype, mask_rows=lambda a, b: built["mask"],
                         kv_frame=KVFrame(N, fill),
                         # the mask's block index table (int32, per block pair) kept for the attention; its build's
                         # block-pair map, sorted values (dtype), sort indices and their argsort (int64), the
                         # thresholded and gathered masks (int32); whole Q beside K and V until then
                         built_held=4 * blocks, built_transient=(2 * e + 24) * blocks, built_inputs=B * N * H * D * e)


def recognize_nabla_attention(name: str, module: nn.Module) -> AttentionSpec | Skip | None:
    """Kandinsky 6 SR's self-attention (its ``Kandinsky6SRAttnProcessor``); None for anything else."""
    mod = sys.modules.get(_MODULE)
    if mod is None or type(module) is not getattr(mod, "Kandinsky6SRAttention", None):
        return None
    skip = lambda why: Skip(name, type(module).__name__, why)  # noqa: E731
    if type(getattr(module, "processor", None)) is not mod.Kandinsky6SRAttnProcessor:
        return skip(f"its processor is {type(getattr(module, 'processor', None)).__name__}, not the "
                    "Kandinsky6SRAttnProcessor streamplan follows")
    problem = unfollowed(module, mod.Kandinsky6SRAttention.forward, _sources(mod), FOLLOWED)
    if problem:
        return skip(problem)
    return followed_spec(module, "diffusers Kandinsky6SRAttention[flex NABLA BlockMask]", module.num_heads,
                         module.to_query.out_features, module.out_layer,
                         lambda args, kwargs: _bind_nabla(module, mod, args, kwargs), "flex")


# -- the block captured whole ----------------------------------------------------------------------------------------
@torch.library.custom_op("streamplan::nabla_block_tables", mutates_args=())
def nabla_block_tables(query: torch.Tensor, key: torch.Tensor, sta: torch.Tensor, threshold: float,
                       block_size: int) -> torch.Tensor:
    """The library's ``nabla_block_mask`` on every row's Q and K ([B, rows, H, D], as the processor holds them), its
    block tables packed (``attention.flex.full_block_tables``)."""
    mask = sys.modules[_MODULE].nabla_block_mask(query.transpose(1, 2), key.transpose(1, 2), sta, thr=threshold,
                                                 block_size=block_size)
    if bool(mask.kv_num_blocks.any()):   # the followed builder marks every chosen block full: a change is an error
        raise RuntimeError("NABLA mask with partial blocks: its tables cannot stand for it")
    return full_block_tables(mask)


@nabla_block_tables.register_fake
def _(query, key, sta, threshold, block_size):
    blocks = sta.shape[-1]   # the prior's blocks: the rows' (the signature the capture is kept under holds it)
    return query.new_empty((query.shape[0], query.shape[2], blocks, 1 + blocks), dtype=torch.int32)


# what the library's builder allocates per (batch, head, query block, key block) besides the tables it gives: the
# block-pair scores, their softmax, sorted values and indices, the argsort back, the thresholded, gathered and OR-ed
# masks, the mask's argsort and BlockMask.from_kv_blocks's transposed tables (fp32, the widest; measured on the
# meter at 64 and 128 blocks: 48.2 and 47.1)
BUILD_PAIR_BYTES = 48


def _tables_workspace(tables, query, key, sta, threshold, block_size) -> int:
    """``nabla_block_tables``'s allocations besides its tables (``BUILD_PAIR_BYTES`` a block pair, and the block
    means of Q and K), from the values a graph holds; 0 where a size is symbolic."""
    sizes = (query.shape[0], query.shape[2], query.shape[3], tables.shape[-2])
    if not all(isinstance(n, int) for n in sizes):
        return 0
    batch, heads, dim, blocks = sizes
    return batch * heads * blocks * (BUILD_PAIR_BYTES * blocks + 2 * dim * query.element_size())


register_row_contraction_op("streamplan", "nabla_block_tables", workspace=_tables_workspace)


def _traced_nabla(q, k, sta, thr=0.9, block_size=_MASK_BLOCK):
    """Stands in for ``nabla_block_mask`` while a block is traced: its tables, from Q and K as the processor holds
    them (it passes their [B, H, rows, D] views)."""
    return torch.ops.streamplan.nabla_block_tables(q.transpose(1, 2), k.transpose(1, 2), sta, float(thr),
                                                   int(block_size))


def _traced_dispatch(query, key, value, attn_mask=None, backend=None, parallel_config=None, **rest):
    """Stands in for ``dispatch_attention_fn`` while a block is traced: the flex call on the tables, [B, rows, H, D]
    in and out as diffusers' flex backend takes and gives them."""
    if rest or parallel_config is not None or not isinstance(attn_mask, torch.Tensor):
        raise RuntimeError("a NABLA flex dispatch streamplan does not follow")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return torch.ops.streamplan.flex_block_attention(q, k, v, attn_mask, None).transpose(1, 2)


def _followed_attentions(block: nn.Module) -> list[nn.Module]:
    """The NABLA attentions inside ``block`` whose processor and sources are the ones streamplan follows."""
    mod = sys.modules.get(_MODULE)
    cls = getattr(mod, "Kandinsky6SRAttention", None)
    if cls is None:
        return []
    found = [m for m in block.modules() if type(m) is cls]
    if not found or any(source_fingerprint(fn) != FOLLOWED[name] for name, fn in _sources(mod).items()):
        return []
    return [m for m in found if type(getattr(m, "processor", None)) is mod.Kandinsky6SRAttnProcessor
            and getattr(m.processor, "_parallel_config", None) is None]


def _nabla_backend(block: nn.Module) -> str | None:
    """A block with a followed NABLA attention attends through flex (its processor dispatches there, whatever the
    active backend)."""
    return "flex" if _followed_attentions(block) else None


@contextlib.contextmanager
def _stand_ins(mod) -> Iterator[None]:
    saved = mod.nabla_block_mask, mod.dispatch_attention_fn
    mod.nabla_block_mask, mod.dispatch_attention_fn = _traced_nabla, _traced_dispatch
    try:
        yield
    finally:
        mod.nabla_block_mask, mod.dispatch_attention_fn = saved


def _while_traced(block: nn.Module):
    """The processor's mask builder and flex dispatch as graph ops while a block with a followed NABLA attention, and
    no other, is traced (an unfollowed one keeps the trace as it was: it fails, and the block stays stock)."""
    mod = sys.modules.get(_MODULE)
    cls = getattr(mod, "Kandinsky6SRAttention", None)
    if cls is None or not any(type(m) is cls for m in block.modules()):
        return None
    if len(_followed_attentions(block)) != sum(type(m) is cls for m in block.modules()):
        return None
    return _stand_ins(mod)


register_backend_probe(_nabla_backend)
register_capture_context(_while_traced)
