"""What a linear layer's weight format allows the executors to do with it.

Every format allows row chunks (the layer's own forward on a chunk of rows: exact for weight-only formats, whose
kernels quantise nothing per call) unless it says why not (``rows``). Feature slices are allowed only where the layout
slices and the executors can run the slice: output features (rows of the weight, with their own scales) for an MLP's
input projections, input features (columns, accumulated) for its output projection. A format a library ships is
declared here by its weight (or layer) class; an unknown layer is applied whole on row chunks only, and one that a
block capture cannot trace is taken by it as one opaque op (``opaque``: ``graph.opaque_layers``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LinearCaps:
    out_slice: bool     # rows of the weight (output features) can be used alone
    in_slice: bool      # columns of the weight (input features) can be used alone
    align: int = 1      # slices must start and end on multiples of this
    opaque: bool = False  # a capture takes the layer as one op (graph.opaque_layers), run by its own forward
    rows: str | None = None  # why a chunk of rows is not the layer's math (None: row chunks are exact)
    name: str = ""      # the format, for reports
    note: str = ""      # what the layout allows beyond what is declared, or why it does not trace


ROWS_ONLY = LinearCaps(out_slice=False, in_slice=False, name="unknown layer")
_DENSE = LinearCaps(out_slice=True, in_slice=True, align=1, name="dense")


@dataclass(frozen=True)
class WeightFormat:
    library: str
    matches: Callable[[nn.Module], bool]
    caps: LinearCaps


_FORMATS: list[WeightFormat] = []


def register_weight_format(library: str, matches: Callable[[nn.Module], bool], caps: LinearCaps) -> None:
    """Declare what layers ``matches`` picks allow (first match wins, in registration order)."""
    _FORMATS.append(WeightFormat(library, matches, caps))


def _plain(w: object) -> bool:
    return type(w) in (nn.Parameter, torch.Tensor)


def linear_caps(module: nn.Module) -> LinearCaps:
    """Plain ``nn.Linear`` with a plain weight allows slicing; a declared format what it declares; an unknown layer
    (LoRA-wrapped, patched, an undeclared quantised weight, ...) is applied whole."""
    if "forward" in module.__dict__:
        return ROWS_ONLY
    weight = getattr(module, "weight", None)
    if type(module) is nn.Linear and _plain(weight):
        return _DENSE
    for fmt in _FORMATS:
        try:
            if fmt.matches(module):
                return fmt.caps
        except Exception:  # a matcher must never break planning: an error means "not this format"
            continue
    return ROWS_ONLY


def can_slice_out(*modules: nn.Module) -> bool:
    return all(linear_caps(m).out_slice for m in modules)


def can_slice_in(*modules: nn.Module) -> bool:
    return all(linear_caps(m).in_slice for m in modules)


def slice_align(*modules: nn.Module) -> int:
    align = 1
    for m in modules:
        a = linear_caps(m).align
        align = align * a // _gcd(align, a)
    return align


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _weight_class(prefix: str, *names: str) -> Callable[[nn.Module], bool]:
    def matches(module: nn.Module) -> bool:
        cls = type(getattr(module, "weight", None))
        return cls.__module__.startswith(prefix) and cls.__name__ in names and isinstance(module, nn.Linear)
    return matches


# torchao weight-only (quantize_ keeps nn.Linear and swaps the weight for a tensor subclass): int8 and float8 with a
# scale per output row. F.linear on a row slice of the weight is exact (its rows and their scales); the layout allows
# column slices too (one scale per row covers every column), but the accumulating output projection transposes the
# slice and adds into an out= buffer, which torchao 0.18 does not implement for them: row slices only.
_TORCHAO_NOTE = ("the layout allows column slices (one scale per output row), but torchao does not implement the "
                 "transposed slice and addmm(out=) the sliced output projection needs")
register_weight_format("torchao", _weight_class("torchao", "Int8Tensor"), LinearCaps(
    out_slice=True, in_slice=False, name="torchao int8 weight-only", note=_TORCHAO_NOTE))
register_weight_format("torchao", _weight_class("torchao", "Float8Tensor"), LinearCaps(
    out_slice=True, in_slice=False, name="torchao float8 weight-only", note=_TORCHAO_NOTE))
# older torchao: AffineQuantizedTensor (int8 weight-only among others; the layout decides what slices): rows only
register_weight_format("torchao", _weight_class("torchao", "AffineQuantizedTensor", "LinearActivationQuantizedTensor"),
                       LinearCaps(out_slice=False, in_slice=False, name="torchao affine-quantized"))


def _bnb_layer(*names: str) -> Callable[[nn.Module], bool]:
    def matches(module: nn.Module) -> bool:
        cls = type(module)
        return any(c.__module__.startswith("bitsandbytes") and c.__name__ in names for c in cls.__mro__)
    return matches


# bitsandbytes: the layer's forward is bnb's own matmul; a capture with fake tensors cannot trace it (its weight's
# CB/SCB or quant_state are attributes of the real parameter), so a block capture takes the layer as one opaque op,
# run by the layer's own forward on each chunk of rows.
register_weight_format("bitsandbytes", lambda m: _bnb_layer("Linear8bitLt")(m) and _bnb_threshold(m) > 0, LinearCaps(
    out_slice=False, in_slice=False, name="bitsandbytes 8-bit (Int8Params) with an outlier threshold",
    rows="its outlier columns are those over the threshold in any row of the call (LLM.int8's decomposition): a "
         "chunk of rows would pick its own"))
register_weight_format("bitsandbytes", _bnb_layer("Linear8bitLt"), LinearCaps(
    out_slice=False, in_slice=False, opaque=True, name="bitsandbytes 8-bit (Int8Params)",
    note="int8 rows with a scale each (SCB) would slice by output feature, but the layer quantises its input per row "
         "over all input features, so only bnb's matmul on whole rows is its math"))
register_weight_format("bitsandbytes", _bnb_layer("Linear4bit", "LinearNF4", "LinearFP4"), LinearCaps(
    out_slice=False, in_slice=False, opaque=True, name="bitsandbytes 4-bit (Params4bit)",
    note="4-bit values packed in blocks of quant_state.blocksize along the flattened weight, one absmax per block "
         "(itself quantised with nested quantisation): no slice is a weight of its own"))


def _bnb_threshold(module: nn.Module) -> float:
    state = getattr(module, "state", None)
    return float(getattr(state, "threshold", 0.0) or 0.0)

