"""Extension points: what a host library's integration declares so the generic path can take its blocks (row-local
custom ops, capture-time settings and contexts, opaque layers, argument records, attention backends, call adapters and
describers, state objects). Each registry is filled at import by the library's file under
``streamplan.integrations``."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn

from .specs import AdaptedCall

# Custom ops (by namespace and name) a library's recognizer declares row-local, for the captured-graph analysis:
# "rows": every output row is its inputs' own rows (rotary with a per-row table, norms over a head's features);
# "norm": a norm over the last dimension with elementwise modulation (rows must not be that dimension).
ROW_LOCAL_CUSTOM_OPS: dict[tuple[str, str], Literal["rows", "norm"]] = {}


def register_row_local_op(namespace: str, name: str, kind: Literal["rows", "norm"]) -> None:
    if kind not in ("rows", "norm"):
        raise ValueError(f"kind must be 'rows' or 'norm', got {kind!r}")
    ROW_LOCAL_CUSTOM_OPS[(namespace, name)] = kind


# Custom ops (by namespace and name) that contract over every row of their inputs into a value without rows (a mask
# chosen from every row's block statistics): computed once in phase KV from their inputs built whole
# (``graph.row_contractions``).
ROW_CONTRACTION_OPS: set[tuple[str, str]] = set()
# What such an op allocates in its call besides its result, where it declares it: ``(result, *args) -> bytes`` on
# the values the graph holds (``graph.memory`` prices it at the op's moment in phase KV).
ROW_CONTRACTION_WORKSPACE: dict[tuple[str, str], Callable[..., int]] = {}


def register_row_contraction_op(namespace: str, name: str, workspace: Callable[..., int] | None = None) -> None:
    ROW_CONTRACTION_OPS.add((namespace, name))
    if workspace is not None:
        ROW_CONTRACTION_WORKSPACE[(namespace, name)] = workspace


# Private attributes a module's forward reads as settings (peft: an adapter switched off, the active adapter's name),
# declared by the library's recognizer file: a capture depends on their values (``graph.export.structure``).
CAPTURE_STATE_ATTRS: set[str] = set()


def register_capture_state(*names: str) -> None:
    CAPTURE_STATE_ATTRS.update(names)


# What a library changes while a block of its is captured, and only then: ``(block) -> context manager | None``
# (ComfyUI: its selected attention function, Sage say, does not trace; the capture traces its PyTorch one, while the
# streamed chunks still go to the selected one through the consumer).
CAPTURE_CONTEXTS: list[Callable[[nn.Module], "AbstractContextManager | None"]] = []


def register_capture_context(context: Callable[[nn.Module], "AbstractContextManager | None"]) -> None:
    if context not in CAPTURE_CONTEXTS:
        CAPTURE_CONTEXTS.append(context)


# Modules a capture takes as one opaque row-local op (``graph.opaque_layers``), run by the module's own forward on each
# chunk of rows, declared by whoever knows them: bitsandbytes' linears (``recognize.generic``, from
# ``plan.weight_formats.LinearCaps.opaque``: their matmul reads the real parameter's quantisation state) and
# mixture-of-experts feed-forwards (``integrations.experts``: each token is routed by its own row).
OPAQUE_LAYERS: list["OpaqueKind"] = []


@dataclass(frozen=True)
class OpaqueKind:
    """A kind of module a capture takes whole: ``matches(module)``; ``refusal(module)``, why a matching module may not
    be taken (its block then stays stock, named), or None; ``out_features(module, x)`` of its output rows;
    ``workspace(module, x)`` -> (bytes per call, bytes per row of the call) it may allocate inside, at most, for an
    input like ``x`` (a fake tensor at capture); ``second(module)``, where its forward returns a per-token tensor
    beside its rows (router scores), that tensor's (features, dtype, whether its tokens are flattened
    [batch * rows, features]), else None; ``work(module, x)`` -> (FLOPs per token, kernel launches per call) for the
    time model, or None: a linear of its input and output widths, one launch."""

    name: str
    matches: Callable[[nn.Module], bool]
    out_features: Callable[[nn.Module, torch.Tensor], int]
    workspace: Callable[[nn.Module, torch.Tensor], tuple[int, int]]
    refusal: Callable[[nn.Module], "str | None"] = lambda m: None
    second: Callable[[nn.Module], "tuple[int, torch.dtype, bool] | None"] = lambda m: None
    work: Callable[[nn.Module, torch.Tensor], "tuple[float, int] | None"] = lambda m, x: None


def register_opaque_layer(kind: OpaqueKind) -> None:
    if kind not in OPAQUE_LAYERS:
        OPAQUE_LAYERS.append(kind)


# Argument records: dataclasses of tensors a block takes as arguments (ComfyUI Flux's ``ModulationOut``), declared by
# the library's recognizer file as "module:QualName". The capture flattens them into their fields (registering them
# as pytree nodes when first met); any other object argument keeps its block stock.
ARGUMENT_RECORDS: set[str] = set()


def register_argument_record(path: str) -> None:
    if ":" not in path:
        raise ValueError(f"an argument record is named 'module:QualName', got {path!r}")
    ARGUMENT_RECORDS.add(path)


# Cache objects a block may be handed and only read (a pipeline's per-layer K/V cache on its cached steps), declared
# by the library's recognizer file as "module:QualName": the capture takes them as their tensors
# (``graph.cache_views``); a call that writes one keeps its stock call, named.
READ_CACHES: set[str] = set()


def register_read_cache(path: str) -> None:
    if ":" not in path:
        raise ValueError(f"a read cache is named 'module:QualName', got {path!r}")
    READ_CACHES.add(path)


# Who decides a captured block's attention kernel: a library whose modules dispatch attention through a backend of
# their own (diffusers' attention backends) registers a probe ``(block) -> backend name | None``; a block whose
# backend has no streamplan consumer runs stock, named, as a hand-written attention does.
BACKEND_PROBES: list[Callable[[nn.Module], "str | None"]] = []


def register_backend_probe(probe: Callable[[nn.Module], "str | None"]) -> None:
    if probe not in BACKEND_PROBES:
        BACKEND_PROBES.append(probe)


def block_backend(block: nn.Module) -> str | None:
    """The attention backend a block's own library dispatches to, where one says (None: plain PyTorch SDPA)."""
    return _first_answer(BACKEND_PROBES, block)


# A library whose blocks take an object a capture cannot (transformers' caches) registers an adapter
# ``(block, args, kwargs) -> AdaptedCall | reason | None`` (None: not this library's call).
CALL_ADAPTERS: list[Callable[[nn.Module, tuple, dict], "AdaptedCall | str | None"]] = []


def register_call_adapter(adapter: Callable[[nn.Module, tuple, dict], "AdaptedCall | str | None"]) -> None:
    if adapter not in CALL_ADAPTERS:
        CALL_ADAPTERS.append(adapter)


def _first_answer(hooks: list[Callable], *args) -> Any:
    """The first registered hook's answer that is not None (None: no hook claims the call)."""
    for hook in hooks:
        found = hook(*args)
        if found is not None:
            return found
    return None


def adapt_call(block: nn.Module, args: tuple, kwargs: dict) -> "AdaptedCall | str | None":
    return _first_answer(CALL_ADAPTERS, block, args, kwargs)


# A library whose block takes a value no capture can hold but streamplan can describe (Wan Animate 2's flex
# ``BlockMask``) registers a describer ``(block, args, kwargs) -> (args, kwargs) | reason | None``: the call with
# those values replaced by described ones (a ``RowMask``) and plain values the capture bakes in (None: not its call;
# a reason: the call runs stock, named). The stock forward, wherever the block runs stock, gets the call as given.
CALL_DESCRIBERS: list[Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | str | None"]] = []


def register_call_describer(describer: Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | str | None"]
                            ) -> None:
    if describer not in CALL_DESCRIBERS:
        CALL_DESCRIBERS.append(describer)


def describe_call(block: nn.Module, args: tuple, kwargs: dict) -> "tuple[tuple, dict] | str | None":
    return _first_answer(CALL_DESCRIBERS, block, args, kwargs)


# A library whose calls pass objects that hold tensors (transformers' caches) registers how to list them:
# ``(value) -> list of tensors | None`` (None: not its object). Those objects count toward a call's live inputs and are
# copied whole for a reference run (``execute.compare.private_copy``).
STATE_TENSORS: list[Callable[[Any], "list[torch.Tensor] | None"]] = []


def register_state_tensors(lister: Callable[[Any], "list[torch.Tensor] | None"]) -> None:
    if lister not in STATE_TENSORS:
        STATE_TENSORS.append(lister)


def state_tensors(value: Any) -> "list[torch.Tensor] | None":
    """The tensors a registered state object (a cache) holds, or None when ``value`` is not one."""
    for lister in STATE_TENSORS:
        found = lister(value)
        if found is not None:
            return found
    return None


# A library whose models come inside a pipeline object (diffusers' ``DiffusionPipeline``) registers how to find the
# modules ``apply(pipeline)`` streams: ``(obj) -> [(component name, module), ...] | None`` (None: not its object).
PIPELINE_READERS: list[Callable[[Any], "list[tuple[str, nn.Module]] | None"]] = []


def register_pipeline_reader(reader: Callable[[Any], "list[tuple[str, nn.Module]] | None"]) -> None:
    if reader not in PIPELINE_READERS:
        PIPELINE_READERS.append(reader)


def pipeline_parts(obj: Any) -> "list[tuple[str, nn.Module]] | None":
    """The modules of a registered pipeline object that ``apply`` streams, or None when ``obj`` is not one."""
    for reader in PIPELINE_READERS:
        found = reader(obj)
        if found is not None:
            return found
    return None
