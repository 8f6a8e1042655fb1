"""PyTorch's flex attention (``torch.nn.attention.flex_attention``) as a consumer: a chunk of query rows against the
whole K/V under the call's ``BlockMask``, cut to the chunk's query blocks.

A ``BlockMask`` holds, per block of query rows, the key blocks to visit (and which of them need no ``mask_mod``), and
the ``mask_mod`` that decides each element from the *global* query and key indices. A chunk of query rows
[a, a + c) with ``a`` a multiple of the query block size takes those blocks' rows of the block tables as they are,
and sees its rows through a ``mask_mod`` (and ``score_mod``) called with the query index shifted by ``a``: every
element of the chunk is decided, and scored, as in the call over every query row. A chunk that starts inside a
query block (a retried half) visits every key block, each element decided by the ``mask_mod``: the same
elements again. Uncompiled, flex attention runs one fp32 softmax per query row over every key
(what the stock call does, row for row); compiled, it visits the block tables' key blocks.

Calls without a flex mask (a plain SDPA of a block whose other attentions dispatch to flex) are PyTorch SDPA's, as
stock runs them. A captured graph holds a mask whose visited blocks are all full (no ``mask_mod``) as one int32 tensor
of its block tables (``full_block_tables``), attended by ``streamplan::flex_block_attention``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128   # torch's default sparse block size: the chunk alignment this consumer asks of the planner
# a graph's packed tables unpacked (``tables_block_mask``), in multiples of the tables' bytes: what the BlockMask holds
# through the call's Q chunks (its key-block indices and the two transposed tables torch derives from them), and the
# most alive at once while it is made (measured on the meter: 3.0 and 8.2)
UNPACKED_TABLES, UNPACKING_TABLES = 3, 9


@dataclass(frozen=True, eq=False)
class FlexMask:
    """What a flex call is given besides Q, K and V: its ``BlockMask`` (None: every key) and ``score_mod``, both over
    the call's global indices; the consumer cuts them to each chunk."""

    block_mask: BlockMask | None
    score_mod: Callable | None = None


def block_mask_problem(block_mask: BlockMask, *, q_len: int, kv_len: int, q_align: int = Q_BLOCK) -> str | None:
    """Why a chunked call cannot stand for the call under ``block_mask`` over ``q_len`` x ``kv_len`` (None: it can):
    a mask already sliced (it has no ``mask_mod`` left), one made for other lengths, one whose query blocks do not
    divide the chunk alignment, or with a backward order only torch's own slicing knows."""
    if getattr(block_mask, "mask_mod", None) is None or "sliced" in getattr(block_mask.mask_mod, "__name__", ""):
        return "its flex BlockMask was sliced (no mask_mod left to decide a chunk's elements)"
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        return (f"its flex BlockMask is for {block_mask.seq_lengths[0]} x {block_mask.seq_lengths[1]} rows, the call "
                f"attends {q_len} x {kv_len}")
    q_block = block_mask.BLOCK_SIZE[0]
    if q_align % q_block:
        return (f"its flex BlockMask's query blocks of {q_block} rows do not divide the chunk alignment ({q_align}): "
                "a chunk would start inside a block")
    if getattr(block_mask, "dq_kv_order", None) is not None:
        return "its flex BlockMask carries a backward order (dq_kv_order) a chunk cannot take"
    return None


def full_block_tables(block_mask: BlockMask) -> torch.Tensor:
    """A mask whose visited blocks are all full as one int32 tensor a graph can hold: per query block, the count of
    key blocks it visits, then their indices (``[..., q_blocks, 1 + kv_blocks]``)."""
    return torch.cat([block_mask.full_kv_num_blocks.unsqueeze(-1), block_mask.full_kv_indices], -1)


def tables_block_mask(tables: torch.Tensor, kv_len: int) -> BlockMask:
    """The ``BlockMask`` ``full_block_tables`` packed, for ``kv_len`` keys: the same tables, every block full."""
    num, idx = tables[..., 0].clone(), tables[..., 1:].clone()   # copies: the mask does not keep ``tables`` alive
    block = kv_len // idx.shape[-1]
    return BlockMask.from_kv_blocks(torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=block, mask_mod=None)


@torch.library.custom_op("streamplan::flex_block_attention", mutates_args=())
def flex_block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Flex attention ([B, H, rows, D]) under the mask ``full_block_tables`` packed into ``attn_mask``: how a captured
    graph holds such a call (the graph's executor attends it through ``FlexConsumer`` one Q chunk at a time)."""
    return flex_attention(query, key, value, block_mask=tables_block_mask(attn_mask, key.shape[-2]), scale=scale)


@flex_block_attention.register_fake
def _(query, key, value, attn_mask, scale=None):
    return query.new_empty(query.shape[:-1] + (value.shape[-1],))


def _at_rows(fn: Callable, offset: int, score: bool) -> Callable:
    """``fn`` (a mask_mod, or with ``score`` a score_mod) seeing a chunk's query index ``q`` as ``q + offset``."""
    if score:
        def shifted_score(s, b, h, q, kv):
            return fn(s, b, h, q + offset, kv)
        return shifted_score

    def shifted_mask(b, h, q, kv):
        return fn(b, h, q + offset, kv)
    return shifted_mask


def chunk_block_mask(block_mask: BlockMask, q_offset: int, rows: int) -> BlockMask:
    """``block_mask`` for query rows [q_offset, q_offset + rows) against every key: its query blocks' rows of the
    tables and a ``mask_mod`` over the chunk's global query indices (``_at_rows``)."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    kv_len = block_mask.seq_lengths[1]
    first, last = q_offset // q_block, -(-(q_offset + rows) // q_block)
    mask_mod = _at_rows(block_mask.mask_mod, q_offset, score=False)
    if q_offset % q_block == 0:
        take = slice(first, last)
        full = (block_mask.full_kv_num_blocks[..., take], block_mask.full_kv_indices[..., take, :]) \
            if block_mask.full_kv_num_blocks is not None else (None, None)
        return BlockMask.from_kv_blocks(block_mask.kv_num_blocks[..., take], block_mask.kv_indices[..., take, :],
                                        *full, BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod,
                                        seq_lengths=(rows, kv_len))
    # inside a block (a retried half): every key block visited, every element decided by the mask_mod
    lead = block_mask.kv_num_blocks.shape[:-1]
    blocks, kv_blocks = -(-rows // q_block), -(-kv_len // kv_block)
    device = block_mask.kv_num_blocks.device
    num = torch.full((*lead, blocks), kv_blocks, dtype=torch.int32, device=device)
    idx = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(*lead, blocks, kv_blocks).contiguous()
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod,
                                    seq_lengths=(rows, kv_len))


def flex_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, mask: FlexMask,
               scale: float | None) -> torch.Tensor:
    """Query rows [q_offset, q_offset + c) (q [B, H, c, D]) against every key (k, v [B, Hkv, keys, D]) under the
    call's flex mask, cut to the chunk."""
    rows = q.shape[-2]
    chunk_mask = chunk_block_mask(mask.block_mask, q_offset, rows) if mask.block_mask is not None else None
    score_mod = _at_rows(mask.score_mod, q_offset, score=True) if mask.score_mod is not None else None
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=chunk_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1])


class FlexConsumer:
    """Serves the ``flex`` backend: a ``FlexMask`` call through flex attention one Q chunk at a time (``flex_chunk``);
    any other call (a plain SDPA of the same block) through ``sdpa``, as stock runs it."""

    name = "flex"

    def __init__(self, caps, sdpa):
        self.caps, self.sdpa = caps, sdpa
        self._tables: tuple = (None, None)   # the last packed tables (a graph's mask, read by every Q chunk) unpacked

    def workspace_row_bytes(self, *, heads: int, head_dim: int, elem: int, causal: bool, masked: bool,
                            keys: int | None = None, batch: int = 1) -> int:
        """Per query row of a chunk, uncompiled flex attention's scores over every key: fp32 scores, the modded
        scores, the softmax and (16-bit inputs) its cast, beside boolean masks of the same size (torch's
        ``math_attention``)."""
        if keys is None:
            return 0
        return batch * heads * keys * (3 * 4 + 2 + (elem if elem < 4 else 0))

    def graph_mask_bytes(self, mask: torch.Tensor) -> tuple[int, int]:
        """For a graph's mask (its value as the graph holds it): the bytes this consumer keeps for it through the
        call's Q chunks, and the most it allocates at once while making them (at the first chunk, before its
        scores); (0, 0) for a mask it attends as given."""
        if mask.dtype != torch.int32:
            return 0, 0
        packed = mask.numel() * mask.element_size()
        return UNPACKED_TABLES * packed, UNPACKING_TABLES * packed

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, causal: bool,
               mask, scale: float | None, **extra) -> torch.Tensor:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.int32:   # a graph's ``full_block_tables``
            mask = self._unpacked(mask, k.shape[-2])
        if isinstance(mask, FlexMask):
            if causal or extra:
                raise ValueError("a flex call takes its causality and scores from its BlockMask and score_mod")
            return flex_chunk(q, k, v, q_offset=q_offset, mask=mask, scale=scale)
        return self.sdpa.attend(q, k, v, q_offset=q_offset, causal=causal, mask=mask, scale=scale, **extra)

    def _unpacked(self, tables: torch.Tensor, kv_len: int) -> FlexMask:
        """The call's mask from its packed tables, unpacked once for all of its Q chunks."""
        held, mask = self._tables
        if held is None or held() is not tables:
            mask = FlexMask(tables_block_mask(tables, kv_len))
            self._tables = (weakref.ref(tables, self._drop), mask)
        return mask

    def _drop(self, ref: weakref.ref) -> None:
        """The unpacked mask dropped with its tables (the call's end): nothing of a call is held past it."""
        if self._tables[0] is ref:
            self._tables = (None, None)
