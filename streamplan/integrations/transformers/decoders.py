"""transformers decoder models (``LlamaModel`` and the same-shaped Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2 and
Gemma3 text models, and their ``*ForCausalLM``): everything streamplan knows about their model forwards, in one place.

The model forward is the library's own, step for step (embeddings, cache, positions, masks and rotary tables from the
model's own functions and modules), except that the embedding output is the one whole-sequence residual: each layer
gets it donated (a layer streamed from its captured graph writes its output into it), nothing else keeps it, and the
final norm runs on row chunks in place. The causal LM head runs on the rows ``logits_to_keep`` asks for only, straight
into its one logits buffer, soft-capped in place where the family soft-caps.

The layers themselves are streamplan's business elsewhere: from their captured graph, or, for the calls a graph cannot
take (a cache, a padding or sliding-window mask transformers materialises as ``[B, 1, N, N]``), their stock forward
with its parts' own specs. Whatever a layer does, it says in the report.

A forward is followed only at the transformers versions whose source was checked (``FORWARDS``: its fingerprint);
any other keeps its stock forward, and the report says which versions are known.
"""
from __future__ import annotations

import functools
import sys
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

from ...execute.chunk_loop import for_chunks
from ...execute.donation import donate
from ...execute import host_rows
from ...execute.hook_chains import chain_of, takes_described, torch_hooks
from ...execute.row_tables import described_together
from ...specs import HostRows, ModelSpec, RowLoops, RowMask, Skip, described_whole
from ...recognize.checks import call_args, global_hook_problem, source_fingerprint, stock_problem

# the cache argument's name, by the transformers version whose source was read (5.2x renamed past_key_values)
CACHE_NAME = {"5.24.0": "cache", "5.17.0": "past_key_values"}

# class name -> {source fingerprint of its forward: transformers version}; read from each version's own source
FORWARDS: dict[str, dict[str, str]] = {
    "LlamaModel": {"b6b92004ca16bcbb": "5.24.0", "710254fe29d2f1e3": "5.17.0"},
    "MistralModel": {"23faa40952888af5": "5.24.0", "611747843c7d83db": "5.17.0"},
    "Phi3Model": {"23faa40952888af5": "5.24.0", "611747843c7d83db": "5.17.0"},
    "Qwen2Model": {"992d9ddaa5fd74ff": "5.24.0", "075bd337bad2b6ca": "5.17.0"},
    "Qwen3Model": {"992d9ddaa5fd74ff": "5.24.0", "075bd337bad2b6ca": "5.17.0"},
    "GemmaModel": {"598dcac795c60565": "5.24.0", "ca9fac08db16b66b": "5.17.0"},
    "Gemma2Model": {"7620e957dc8e4eb2": "5.24.0", "2b13e9d8b308f163": "5.17.0"},
    "Gemma3TextModel": {"dab0c01458257fb4": "5.24.0", "2575c6c3832be297": "5.17.0"},
    "LlamaForCausalLM": {"8b93ce9b4afccbb9": "5.24.0", "d5cbd5be940bb654": "5.17.0"},
    "MistralForCausalLM": {"c61b6f1d7e181dd8": "5.24.0", "bcdd238519310865": "5.17.0"},
    "Phi3ForCausalLM": {"91976e368d8cced3": "5.24.0", "d49d174b08ce19dd": "5.17.0"},
    "Qwen2ForCausalLM": {"b417de82d351c7cf": "5.24.0", "d43f438edef58979": "5.17.0"},
    "Qwen3ForCausalLM": {"539c37ef8cce727d": "5.24.0", "409599cb77f34067": "5.17.0"},
    "GemmaForCausalLM": {"cf2257c0f27204a2": "5.24.0", "ae82b0f6ed045fe1": "5.17.0"},
    "Gemma2ForCausalLM": {"3fe3057ade21de85": "5.24.0", "7396490cde01a408": "5.17.0"},
    "Gemma3ForCausalLM": {"ecfecc5aaa7bff39": "5.24.0", "82c4c2a37c97075b": "5.17.0"},
}


@dataclass(frozen=True)
class Family:
    """How one family's model forward differs from Llama's (the same at every version in ``FORWARDS``).

    masks: "causal" (one causal mask), "window" (the sliding-window mask where the config sets a window),
    "by_type" (a mask per layer type, the sliding one only when the model has sliding layers), "by_type_both"
    (both always); both "by_type" kinds take a dict ``attention_mask`` as already prepared."""

    module: str                          # transformers.models.<module>.modeling_<module>
    masks: Literal["causal", "window", "by_type", "by_type_both"]
    rope_per_type: bool = False          # a rotary table per layer type (Gemma3)
    layer_use_cache: bool = True         # the layers are passed ``use_cache``
    cache_if_used: bool = True           # the output holds the cache only when ``use_cache``
    softcap: bool = False                # the causal LM soft-caps its logits (``final_logit_softcapping``)


MODELS: dict[str, Family] = {
    "LlamaModel": Family("llama", "causal", cache_if_used=False),
    "MistralModel": Family("mistral", "window"),
    "Phi3Model": Family("phi3", "window"),
    "Qwen2Model": Family("qwen2", "by_type"),
    "Qwen3Model": Family("qwen3", "by_type"),
    "GemmaModel": Family("gemma", "causal"),
    "Gemma2Model": Family("gemma2", "by_type_both", layer_use_cache=False, cache_if_used=False),
    "Gemma3TextModel": Family("gemma3", "by_type_both", rope_per_type=True, layer_use_cache=False,
                              cache_if_used=False),
}
LMS: dict[str, Family] = {
    "LlamaForCausalLM": MODELS["LlamaModel"], "MistralForCausalLM": MODELS["MistralModel"],
    "Phi3ForCausalLM": MODELS["Phi3Model"], "Qwen2ForCausalLM": MODELS["Qwen2Model"],
    "Qwen3ForCausalLM": MODELS["Qwen3Model"], "GemmaForCausalLM": MODELS["GemmaModel"],
    "Gemma2ForCausalLM": Family("gemma2", "by_type_both", softcap=True),
    "Gemma3ForCausalLM": Family("gemma3", "by_type_both", softcap=True),
}

# keyword arguments the stock forwards pass on to the layers that change nothing when false (capture_outputs reads
# them); streamplan drops them so that the layers' streamed paths are not refused over an unknown keyword
_QUIET_FLAGS = ("output_attentions", "output_hidden_states")


def _names(cache: str, lm: bool) -> tuple[str, ...]:
    base = ("input_ids", "attention_mask", "position_ids", cache, "inputs_embeds")
    return base + (("labels", "use_cache", "logits_to_keep") if lm else ("use_cache",))


def _call(model: nn.Module, version: str, lm: bool, args: tuple, kwargs: dict) -> dict | str:
    """The forward's arguments by name (5.24's deprecated ``past_key_values`` read as ``cache``, as its decorator
    does), ``return_dict`` taken out. A model's output flags (capture_outputs: the keyword, else the config) refuse
    the call when true and are dropped when false; a causal LM passes them on to its model, as stock does."""
    cache = CACHE_NAME[version]
    aliases = {"past_key_values": "cache"} if cache == "cache" else None
    call = call_args(_names(cache, lm), args, kwargs, aliases=aliases, extra=True)
    if isinstance(call, str):
        return call
    call.pop("return_dict", None)
    if not lm:
        for flag in _QUIET_FLAGS:
            if call.pop(flag, getattr(model.config, flag, False)):
                return f"{flag} asks for every layer's {flag[7:].replace('_', ' ')}"
    return call


def _rows(call: dict) -> int | None:
    x = call.get("inputs_embeds") if call.get("input_ids") is None else call.get("input_ids")
    return x.shape[1] if isinstance(x, torch.Tensor) and x.dim() >= 2 else None


def _model_problem(model: nn.Module, family: Family, version: str, call: dict | str) -> str | None:
    """Why this call of a decoder model keeps the stock forward, or None."""
    if isinstance(call, str):
        return call
    extra = sorted(k for k in call if k not in _names(CACHE_NAME[version], False))
    if extra:
        return f"arguments streamplan does not know: {extra}"
    cfg = model.config
    if hasattr(cfg, "is_causal"):
        return "the config sets is_causal"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention)"
    if family.masks != "by_type" and family.masks != "by_type_both" and isinstance(call.get("attention_mask"), dict):
        return "attention_mask is a dict"
    rows = _rows(call)
    if rows is None:
        return "no input_ids [batch, tokens] or inputs_embeds [batch, tokens, dim]"
    if rows < 2:
        return "one token per sequence (a decoding step): nothing to stream"
    if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
        return "gradient checkpointing is active"
    return _hook_problem(model)


def _hook_problem(model: nn.Module) -> str | None:
    """Checked at every call: a hook may keep the hidden states the layers update in place."""
    problem = global_hook_problem()
    if problem:
        return problem
    for name, m in model.named_modules():
        hooks = torch_hooks(m)
        if hooks:
            return f"{name or 'the model'} has {', '.join(hooks)} (a hook may keep hidden states updated in place)"
    return None


def _masks(model: nn.Module, family: Family, cache_name: str, hidden: torch.Tensor, attention_mask, cache,
           position_ids: torch.Tensor) -> list:
    """Each layer's mask, from the model's own mask functions exactly as its forward calls them. Under SDPA a mask
    the library would build over rows x rows reaches a layer that takes row masks as a ``RowMask`` (the library's
    own mask function, evaluated a Q chunk at a time); other layers get the tensor, built once, as stock."""
    mod = sys.modules[type(model).__module__]
    cfg = model.config
    kw = {"config": cfg, "inputs_embeds": hidden, "attention_mask": attention_mask, cache_name: cache,
          "position_ids": position_ids}
    layers = model.layers[: cfg.num_hidden_layers]
    impl = getattr(cfg, "_attn_implementation", None)
    describe = impl in ("sdpa", "eager") and any(takes_described(m) for m in layers)
    made: dict[str, object] = {}

    def make(kind: str):
        if kind not in made:
            fn = mod.create_sliding_window_causal_mask if kind == "sliding" else mod.create_causal_mask
            made[kind] = _described(fn, kw, impl) if describe else fn(**kw)
        return made[kind]

    if family.masks == "causal":
        kinds = ["full"] * len(layers)
    elif family.masks == "window":
        kinds = ["full" if cfg.sliding_window is None else "sliding"] * len(layers)
    elif isinstance(attention_mask, dict):   # already prepared (``generate`` may)
        return [attention_mask[cfg.layer_types[i]] for i in range(len(layers))]
    else:
        sliding = family.masks == "by_type_both" or model.has_sliding_layers
        kinds = ["sliding" if sliding and cfg.layer_types[i] == "sliding_attention" else "full"
                 for i in range(len(layers))]
    out = []
    for kind, layer in zip(kinds, layers):
        mask = make(kind)
        if isinstance(mask, RowMask) and not takes_described(layer):   # built once for every such layer
            if kind + " whole" not in made:
                made[kind + " whole"] = mask.whole()
            mask = made[kind + " whole"]
        out.append(mask)
    return out


# -------------------------------------------------------------------------------------------- masks by Q chunk
_RECORDING: ContextVar[bool] = ContextVar("streamplan_recording_masks", default=False)
_RECORD_LOCK = threading.Lock()


@dataclass(eq=False)
class _Recorded:
    """A call of the library's mask interface, held instead of made."""

    real: Callable
    kw: dict


def _described(fn: Callable, kw: dict, impl: str = "sdpa"):
    """``fn(**kw)`` (transformers' create_causal_mask or create_sliding_window_causal_mask) with its call of the
    ``impl`` mask interface (SDPA's or eager's) held: None where the library would skip the mask (plain causal, SDPA
    only), else a ``RowMask`` whose chunk rows are that interface called for the chunk's query rows and keys; what
    returns before the interface (a 4-D mask given) as it is."""
    from transformers import masking_utils as mu
    interface = mu.ALL_MASK_ATTENTION_FUNCTIONS
    real = interface[impl]

    def recorder(**call):
        return _Recorded(real, call) if _RECORDING.get() else real(**call)

    with _RECORD_LOCK:   # the library's mask interface, replaced for this thread's call alone
        local = interface._local_mapping
        prior = local.get(impl, _NONE)
        local[impl] = recorder
        token = _RECORDING.set(True)
        try:
            got = fn(**kw)
        finally:
            _RECORDING.reset(token)
            if prior is _NONE:
                local.pop(impl, None)
            else:
                local[impl] = prior
    if not isinstance(got, _Recorded):
        return got
    return _row_mask(got, mu, eager=impl == "eager")


_NONE = object()


def _row_mask(rec: _Recorded, mu, eager: bool = False):
    """``eager``: eager attention's additive masks (the library's ``eager_mask``), never skipped, and always as rows
    of its own mask (a padded row that sees no key attends every key evenly there, as stock's does)."""
    c = rec.kw
    rows, keys = c["q_length"], c["kv_length"]
    whole = functools.partial(rec.real, **c)
    ignore, prepare = getattr(mu, "_ignore_causal_mask_sdpa", None), getattr(mu, "prepare_padding_mask", None)
    if ignore is None or prepare is None or c.get("q_offset") != 0 or c.get("kv_offset") != 0 or rows != keys:
        return whole()   # a cache that already holds tokens, or masking code this file was not checked against
    if not eager and c.get("allow_is_causal_skip", True) and ignore(
            prepare(c.get("attention_mask"), keys, 0), rows, keys, 0, 0, c.get("local_size")):
        return None      # the library's own skip: SDPA's is_causal
    window = c.get("local_size")
    causal = not c.get("use_vmap", False)   # no custom or/and mask functions: causal (and windowed where set)

    def span(a: int, b: int) -> tuple[int, int]:
        if not causal:
            return 0, keys
        return (max(0, a - window + 1) if window else 0), b

    def part(a: int, b: int, lo: int, hi: int) -> torch.Tensor:
        return rec.real(**{**c, "q_length": b - a, "kv_length": hi - lo, "q_offset": a, "kv_offset": lo,
                           "allow_is_causal_skip": False})

    spans = _padding_spans(c.get("attention_mask"), keys) if causal and not window else None
    if eager and causal and not window and c.get("attention_mask") is None:   # eager's plain causal mask: no rows
        spans = ((0, keys),) * c["batch_size"]
    return RowMask(c["batch_size"], rows, keys, part, span, whole, window if causal else None, spans,
                   blind_rows_see_all=eager)


def _padding_spans(padding: torch.Tensor | None, keys: int) -> tuple[tuple[int, int], ...] | None:
    """Per batch element, the one run of keys that are not padding ([start, end)), where each row's padding mask is
    such a run (left or right padding, or both); None otherwise. With causality alone that is the whole mask."""
    if padding is None or padding.dim() != 2 or padding.shape[-1] != keys:
        return None
    found = []
    for row in padding.bool().cpu():
        on = row.nonzero().flatten()
        start, end = (int(on[0]), int(on[-1]) + 1) if on.numel() else (0, 0)
        if on.numel() != end - start:
            return None
        found.append((start, end))
    return tuple(found)


def _rope(model: nn.Module, family: Family, hidden: torch.Tensor, position_ids: torch.Tensor,
          described: bool = False) -> list:
    """Each layer's rotary (cos, sin), one per distinct rope type; ``described`` (L6): built a chunk of rows at a
    time from those rows' positions, never whole on the device."""
    layers = model.config.num_hidden_layers
    types = model.config.layer_types if family.rope_per_type else [None] * layers

    def table(kind):
        extra = () if kind is None else (kind,)
        if not described:
            return model.rotary_emb(hidden, position_ids, *extra)
        return described_together(lambda a, b: model.rotary_emb(hidden, position_ids[..., a:b], *extra),
                                  position_ids.shape[-1], (1, 1))

    tables = {kind: table(kind) for kind in dict.fromkeys(types)}
    return [tables[types[i]] for i in range(layers)]


def _norm_in_place(norm: nn.Module, hidden: torch.Tensor | HostRows, chunk: int) -> torch.Tensor | HostRows:
    """``norm(hidden)`` a chunk of rows at a time, written over ``hidden`` (each chunk is read before it is written;
    host rows read back and written back); into a new buffer only where the norm's output dtype differs (stock
    returns that dtype too)."""
    on_host = isinstance(hidden, HostRows)
    x = hidden.tensor if on_host else hidden
    out: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        y = norm(host_rows.rows(hidden, a, b))
        if not out:
            same = y.dtype == x.dtype and y.shape == x[:, a:b].shape
            shape = x.shape[:1] + (x.shape[1],) + y.shape[2:]
            out.append(x if same else host_rows.host_empty(shape, y.dtype, y.device) if on_host
                       else y.new_empty(shape))
        out[0][:, a:b].copy_(y, non_blocking=True)

    for_chunks(x.shape[1], chunk, work)
    if not out:
        return norm(hidden)
    return HostRows(out[0], hidden.device) if on_host else out[0]


def _embedded_on_host(model: nn.Module, input_ids: torch.Tensor, chunk: int) -> HostRows:
    """The embedding's rows a chunk at a time into host memory (L6): nothing the size of the sequence on the device."""
    out: list[torch.Tensor] = []

    def work(a: int, b: int) -> None:
        y = model.embed_tokens(input_ids[:, a:b])
        if not out:
            out.append(host_rows.host_empty((y.shape[0], input_ids.shape[1]) + y.shape[2:], y.dtype, y.device))
        out[0][:, a:b].copy_(y, non_blocking=True)

    for_chunks(input_ids.shape[1], chunk, work)
    return HostRows(out[0], input_ids.device)


def _model_forward(model: nn.Module, family: Family, version: str, call: dict, chunk: RowLoops,
                   hand_host: bool = False):
    """The decoder model's forward (transformers ``version``), with the residual donated to every layer; with
    ``chunk.host`` (L6, no cache to fill) the residual and rotary tables in host memory between layers, the last
    hidden state handed back there where ``hand_host`` (to the causal LM's head), else on the device."""
    mod = sys.modules[type(model).__module__]
    cache_name = CACHE_NAME[version]
    input_ids, inputs_embeds = call.get("input_ids"), call.get("inputs_embeds")
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    use_cache = call.get("use_cache")
    if use_cache is None:   # merge_with_config_defaults
        use_cache = getattr(model.config, "use_cache", None)
    cache = call.get(cache_name)
    host = getattr(chunk, "host", False) and cache is None and not use_cache   # a cache is filled on the device
    # the one whole-sequence residual: the embedding output (or a copy of the caller's embeddings, which stay theirs)
    if host:
        hidden = (_embedded_on_host(model, input_ids, chunk()) if inputs_embeds is None
                  else host_rows.to_host(inputs_embeds, inputs_embeds.device))
    else:
        hidden = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.clone()
    del inputs_embeds
    x = hidden.tensor if host else hidden
    like = torch.empty(x.shape[:2] + (0,), dtype=x.dtype, device=hidden.device) if host else hidden   # shapes only
    del x
    if use_cache and cache is None:
        cache = mod.DynamicCache(config=model.config)
    position_ids = call.get("position_ids")
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(like.shape[1], device=like.device) + past_seen_tokens).unsqueeze(0)
    # positions the forward made itself are one run (never packed): the mask functions are not handed them to check,
    # which reads their values (in a rehearsal they are fake beyond a few thousand rows, and would read as packed)
    masks = _masks(model, family, cache_name, like, call.get("attention_mask"), cache, call.get("position_ids"))
    tables = _rope(model, family, like, position_ids, described=host)
    layer_kw = {"position_ids": position_ids, cache_name: cache}
    if family.layer_use_cache:
        layer_kw["use_cache"] = use_cache
    for i, layer in enumerate(model.layers[: model.config.num_hidden_layers]):
        inputs = (hidden, masks[i], tables[i])
        if host and not takes_described(layer):   # a layer streamplan does not stream: its rows whole
            inputs, _ = described_whole(inputs, {})
        with donate(inputs[0]):
            out = layer(inputs[0], attention_mask=inputs[1], position_embeddings=inputs[2], **layer_kw)
        del inputs
        hidden = host_rows.kept(out, hidden) if host else out
        del out
    del masks, tables
    hidden = _norm_in_place(model.norm, hidden, chunk())
    if host and not hand_host:
        hidden = hidden.whole()
    kept = cache if (use_cache or not family.cache_if_used) else None
    return mod.BaseModelOutputWithPast(last_hidden_state=hidden, **{cache_name: kept})


def _run_model(model: nn.Module, family: Family, version: str, args: tuple, kwargs: dict, chunk: RowLoops):
    """capture_outputs' return_dict (config default, a tuple only when False), around the streamed forward."""
    return_dict = kwargs.get("return_dict", getattr(model.config, "return_dict", True))
    out = _model_forward(model, family, version, _call(model, version, False, args, kwargs), chunk)
    return out.to_tuple() if return_dict is False else out


# ------------------------------------------------------------------------------------------------- causal LM head
def _keep_problem(keep) -> str | None:
    if isinstance(keep, bool) or not (isinstance(keep, int) or (isinstance(keep, torch.Tensor) and keep.dim() == 1
                                                                 and not keep.is_floating_point()
                                                                 and keep.dtype != torch.bool)):
        return "logits_to_keep is not an int or a 1-D tensor of positions"
    return None


def _head(lm: nn.Module, family: Family, hidden: torch.Tensor, keep) -> torch.Tensor:
    """``lm_head`` on the rows ``logits_to_keep`` selects, into its one output buffer, soft-capped in place (stock
    makes two more logits-sized tensors). One call, not row chunks: the buffer is the output either way, and a whole
    call is what streamplan's stock-head watch sizes, reports and holds to a byte budget."""
    rows = slice(-keep, None) if isinstance(keep, int) else keep
    if isinstance(hidden, HostRows):   # L6: the kept rows read back
        n = hidden.shape[1]
        picked = (host_rows.rows(hidden, n - keep if keep else 0, n) if isinstance(keep, int)
                  else host_rows.on_device(hidden.tensor[:, keep.to(hidden.tensor.device), :], hidden.device))
        logits = lm.lm_head(picked)
        del picked
    else:
        logits = lm.lm_head(hidden[:, rows, :])
    cap = lm.config.final_logit_softcapping if family.softcap else None
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def _lm_problem(lm: nn.Module, call: dict | str) -> str | None:
    if isinstance(call, str):
        return call
    if call.get("labels") is not None:
        return "labels are given (the loss)"
    why = _keep_problem(call.get("logits_to_keep", 0))
    if why:
        return why
    rows = _rows(call)
    if rows is not None and rows < 2:
        return "one token per sequence (a decoding step): nothing to stream"
    return _hook_problem(lm)


def _run_lm(lm: nn.Module, family: Family, version: str, args: tuple, kwargs: dict, chunk: RowLoops):
    """The causal LM's forward: its model (streamed through its own installed forward, or stock), then the head."""
    mod = sys.modules[type(lm).__module__]
    cache_name = CACHE_NAME[version]
    return_dict = getattr(lm.config, "return_dict", True) if hasattr(lm, "config") else True   # can_return_tuple
    passed = kwargs.get("return_dict", return_dict)
    return_dict = return_dict if passed is None else passed
    call = _call(lm, version, True, args, {k: v for k, v in kwargs.items() if k != "return_dict"})
    keep = call.pop("logits_to_keep", 0)
    call.pop("labels", None)
    inner = _host_model_call(lm, version, call) if chunk.host else None
    if inner is not None:   # L6: the model's forward here, its last hidden state handed over in host memory
        outputs = _model_forward(lm.model, MODELS[type(lm.model).__name__], version, inner, chunk, hand_host=True)
    else:
        outputs = lm.model(**call)
    logits = _head(lm, family, outputs.last_hidden_state, keep)
    out = mod.CausalLMOutputWithPast(loss=None, logits=logits, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions, **{cache_name: getattr(outputs, cache_name)})
    del outputs
    return out.to_tuple() if not return_dict else out


def _host_model_call(lm: nn.Module, version: str, call: dict) -> dict | None:
    """The causal LM's model call, run here with its rows in host memory (L6), or None where the model's own forward
    must run (hooks on the model, a call its forward streams otherwise or keeps stock)."""
    model = lm.model
    family = MODELS.get(type(model).__name__)
    if family is None or chain_of(model) is not None or _version(model)[0] != version:
        return None
    inner = _call(model, version, False, (), dict(call))
    return None if isinstance(inner, str) or _model_problem(model, family, version, inner) else inner


# ----------------------------------------------------------------------------------------------------- recognizer
def _version(module: nn.Module) -> tuple[str | None, str | None]:
    """(the transformers version whose forward this is, or None; why not)."""
    cls = type(module)
    known = FORWARDS[cls.__name__]
    if cls.forward is not cls.__dict__.get("forward"):
        return None, f"{cls.__name__}.forward is inherited or replaced, not the library's own"
    version = known.get(source_fingerprint(cls.forward))
    if version is None:
        return None, (f"{cls.__name__}.forward differs from the transformers versions streamplan follows "
                      f"({', '.join(sorted(set(known.values())))})")
    return version, None


MODEL_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
PER_CHUNK = ("embed_tokens", "norm", "lm_head")   # called once per row chunk: a weight hook brings them in per chunk


def _parts_problem(module: nn.Module, parts: tuple[str, ...]) -> str | None:
    """Every part is called through its own forward (never its weights read here), so weight hooks on the parts
    (accelerate's per-layer offload, as ``device_map`` with layers on "cpu" installs) run as they would in stock."""
    for part in parts:
        sub = getattr(module, part, None)
        if not isinstance(sub, nn.Module):
            return f"no {part} module"
    if not isinstance(getattr(module, "layers", None), nn.ModuleList) and "layers" in parts:
        return "layers is not a ModuleList"
    problem = stock_problem(module, subtree=False)
    for part in parts:
        if problem:
            return problem
        sub = getattr(module, part)
        problem = (_parts_problem(sub, MODEL_PARTS) if part == "model" else
                   stock_problem(sub, onloads=True, per_chunk=part in PER_CHUNK))
        problem = problem and (problem if problem.startswith(part) else f"{part}: {problem}")
    return problem


def recognize_decoder_model(name: str, module: nn.Module) -> ModelSpec | Skip | None:
    """A transformers decoder model or causal LM whose forward streamplan follows (``FORWARDS``)."""
    cls = type(module)
    family = MODELS.get(cls.__name__) or LMS.get(cls.__name__)
    if family is None or cls.__module__ != f"transformers.models.{family.module}.modeling_{family.module}":
        return None
    lm = cls.__name__ in LMS
    skip = lambda why: Skip(name, cls.__name__, f"model forward left stock: {why}")  # noqa: E731
    version, why = _version(module)
    if version is None:
        return skip(why)
    problem = _parts_problem(module, ("model", "lm_head") if lm else MODEL_PARTS)
    if problem:
        return skip(problem)
    if lm:
        return ModelSpec(module, f"transformers.{cls.__name__}[{version}: head on the kept rows, in place]",
                         run=lambda args, kwargs, chunk: _run_lm(module, family, version, args, kwargs, chunk),
                         can_stream=lambda args, kwargs: _lm_problem(
                             module, _call(module, version, True, args, kwargs)), host_rows=True)
    return ModelSpec(module, f"transformers.{cls.__name__}[{version}: donated layers, norm in row chunks]",
                     run=lambda args, kwargs, chunk: _run_model(module, family, version, args, kwargs, chunk),
                     can_stream=lambda args, kwargs: _model_problem(
                         module, family, version, _call(module, version, False, args, kwargs)), host_rows=True)
