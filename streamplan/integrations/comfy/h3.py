"""ComfyUI's MiniMax-H3 ``DiTBlock`` (``comfy.ldm.minimax.model``): its packed sequence is one sample's rows as
``[rows, features]`` (no batch), and its AdaLN modulation is applied per segment of rows at Python bounds
(``mod_segments``: ``(start, stop, table_row)``), in place. Neither has rows the capture can follow, so the block is
presented to it as ``[1, rows, features]`` with the segments as one per-row index into the modulation tables: the
block's own forward then runs with a single "segment" ``(None, None, index)``, whose slices take every row and whose
table lookup is a per-row gather (the same values, element by element). Everything else the capture traces from the
block's own code (fused QKV, comfy_kitchen's in-place q/k RMSNorm + split-half rope, SwiGLU, the residual updated in
place).

That substitution is only as good as the forward it is made for: ``DiTBlock.forward`` and its two segment helpers are
fingerprinted (their source text) against ComfyUI 0.33.0; any other code keeps the block stock, saying so."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ...recognize.checks import source_fingerprint

CLASS_PATH = "comfy.ldm.minimax.model.DiTBlock"
# source fingerprints (checks.source_fingerprint) of each function, as in ComfyUI 0.33.0. Not ast.dump: its text
# changes with the Python version (3.12 added type_params), which would keep H3 stock on any other Python
KNOWN = {"DiTBlock.forward": "45fdf1af8aaa9bbc", "_mod_scale_shift": "f6fe9eca0bfb3290",
         "_mod_gate": "545028a63585bff7"}
_HELPERS = ("_mod_scale_shift", "_mod_gate")
# comfy.ops layers whose weights the block reads itself, never calling the layer (Attention.forward hands
# ``cast_to(self.q_norm.weight, device=...)`` to comfy_kitchen's fused kernel: stored dtype, no weight patches): left as
# they are when ComfyUI's per-call casts are taken for a streamed call (``streamplan.integrations.comfy.weights``)
DIRECT_WEIGHTS = ("attn.q_norm", "attn.k_norm")
_SEEN: dict[Any, str | None] = {}


def forward_problem(block: nn.Module) -> str | None:
    """Why this block's forward is not the one the per-row substitution was checked against, or None."""
    fwd = type(block).forward
    helpers = tuple(fwd.__globals__.get(h) for h in _HELPERS)
    key = (fwd, helpers)
    if key not in _SEEN:
        found = {"DiTBlock.forward": source_fingerprint(fwd)}
        found.update((h, source_fingerprint(f) if callable(f) else None) for h, f in zip(_HELPERS, helpers))
        odd = [k for k, v in found.items() if v != KNOWN[k]]
        _SEEN[key] = (f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not the code streamplan follows "
                      f"(ComfyUI 0.33.0's): unknown forward") if odd else None
    return _SEEN[key]


def segment_rows(mod_segments: Any, rows: int, device: torch.device) -> torch.Tensor | str:
    """``[(start, stop, table_row), ...]`` covering rows 0..rows contiguously -> each row's table row ``[1, rows]``
    (int64), or why the segments are not that."""
    at = 0
    try:
        for a, b, row in mod_segments:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b, row)) or a != at or b < a:
                return f"mod_segments are not contiguous int (start, stop, row) triples from row 0 ({a, b, row})"
            at = b
    except (TypeError, ValueError):
        return "mod_segments is not a list of (start, stop, row) triples"
    if at != rows:
        return f"mod_segments cover {at} rows of {rows}"
    # built from whole ops (no writes into a fresh tensor): in a forward's rehearsal a small index is a real value and
    # a large one a fake, as every value there (``execute.rehearsal``)
    pieces = [torch.full((1, b - a), row, dtype=torch.int64) for a, b, row in mod_segments]
    return (torch.cat(pieces, dim=1) if pieces else torch.empty(1, 0, dtype=torch.int64)).to(device)


class PackedRows(nn.Module):
    """The block as the capture sees it: ``x`` ``[1, rows, features]`` (a view of the host's packed rows, updated
    in place as the block does), ``mod_rows`` ``[1, rows]`` each row's modulation-table row. Run eagerly (a call the
    streamer runs stock), the block gets the host's own segments and transformer_options (``host``, set per call)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.training = False          # the block's own flag is checked by the caller; never flipped here
        self.host: tuple[list, dict] | None = None

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, mod_rows: torch.Tensor,
                rope_freqs: torch.Tensor) -> torch.Tensor:
        if self.host is not None and not torch.compiler.is_exporting():
            segments, options = self.host
            return self.block(x[0], t_emb, segments, rope_freqs, transformer_options=options).unsqueeze(0)
        return self.block(x[0], t_emb, [(None, None, mod_rows[0])], rope_freqs,
                          transformer_options={"optimized_attention_override": _trace_attention}).unsqueeze(0)


def _trace_attention(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """At capture only: ComfyUI's own PyTorch attention, whatever ``optimized_attention`` is set to (Sage's kernels
    do not trace), so the graph holds an SDPA where the block attends; each streamed Q chunk then goes to the
    attention consumer the host picked (ComfyUI's ``optimized_attention``)."""
    from comfy.ldm.modules.attention import attention_pytorch
    return attention_pytorch(*args, **kwargs)


def whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, transformer_options: dict,
                    scale: float | None) -> torch.Tensor:
    """``Attention.forward``'s one attention call as ComfyUI 0.33.0 makes it (tensor containers, ``mask=None``,
    ``skip_reshape``, the output as ``[1, rows, heads * head_dim]``), given the whole Q, K and V ``[1, heads, rows,
    head_dim]``: an opaque attention override sees the call the stock block makes. Returns ``[1, heads, rows,
    head_dim]``, as the captured graph's attention."""
    from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12 * q.shape[-1] ** -0.5:
        raise ValueError(f"DiTBlock attends at the default scale, the graph gives {scale}")
    b, heads, rows, dim = q.shape
    out = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v),
                              heads, mask=None, skip_reshape=True, transformer_options=transformer_options)
    return out.view(b, rows, heads, dim).transpose(1, 2)
