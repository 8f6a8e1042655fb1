"""Whole transformers decoder models (``streamplan.integrations.transformers.decoders``): tiny random-weight causal LMs
of
each family, streamed against the real model's own forward (logits and cache contents), batch 2, padding, caches,
``logits_to_keep``, the measured peak against the floor, the version fingerprint, and ``remove()``."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import streamplan  # noqa: E402
from conftest import TINY_DECODER, rel_err  # noqa: E402
from streamplan.integrations.transformers import decoders  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = (TINY_DECODER[k] for k in ("hidden_size", "num_attention_heads",
                                                             "num_key_value_heads", "head_dim", "vocab_size"))
WINDOW = 32
N, CHUNK = 200, 64
COMMON = TINY_DECODER
FAMILIES = {   # name -> (model_type, config overrides, the layers whose calls stream from their graph at N tokens)
    "llama": ("llama", {}, [0, 1]),
    "mistral": ("mistral", dict(sliding_window=None), [0, 1]),
    "qwen2": ("qwen2", {}, [0, 1]),
    "qwen3": ("qwen3", {}, [0, 1]),
    "phi3": ("phi3", dict(sliding_window=None), [0, 1]),
    "gemma": ("gemma", {}, [0, 1]),
    # eager attention (transformers refuses SDPA with soft-capping): the hand-written chain found in each layer's
    # graph, its eager masks described (tests/test_row_masks.py)
    "gemma2": ("gemma2", dict(sliding_window=WINDOW), [0, 1]),
    # layer 0 slides over a window shorter than N (its mask rows built per Q chunk), layer 1 attends fully
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
               [0, 1]),
}
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else \
    "past_key_values"


def _lm(name: str, **over):
    model_type, overrides, _ = FAMILIES[name]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides, **over})
    impl = "eager" if model_type == "gemma2" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():   # norms away from one, so a norm applied twice or not at all shows
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _ids(batch=2, n=N):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(n))


def _cache_of(out):
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values


def _same_cache(a, b) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.shape == lb.keys.shape and la.values.shape == lb.values.shape
        assert rel_err(la.keys, lb.keys) <= 1e-5 and rel_err(la.values, lb.values) <= 1e-5


def _notes(handle, prefix: str) -> str:
    return " ".join(n for name, e in handle.installed.items() if name.startswith(prefix) for n in e.runtime_notes)


def _tiers(handle, name: str) -> list[str]:
    return [p.tier for p in handle.plans.get(name, [])]


def _streamed(handle, name: str) -> bool:
    """The model forward at ``name`` streamed every call so far (none ran stock)."""
    entry = handle.installed[name]
    tiers = _tiers(handle, name)
    return bool(tiers) and set(tiers) == {"L1"} and not any("ran stock" in n for n in entry.runtime_notes)


def _restored(model, handle, ids, ref) -> None:
    handle.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, ref)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_family_streams_exactly_and_restores(name):
    model, ids = _lm(name), _ids()
    ref = model(ids, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, use_cache=False).logits
    report = handle.report()
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5, (name, rel_err(out, ref))
    assert _tiers(handle, "") == ["L1"] and _tiers(handle, "model") == ["L1"], report
    assert "model forward ran stock" not in report
    for i in range(2):
        tiers = _tiers(handle, f"model.layers.{i}")
        if i in FAMILIES[name][2]:
            assert tiers == ["L1"] and handle.plans[f"model.layers.{i}"][0].rows == N, report
        else:   # a layer that keeps its stock forward says why
            assert "L1" not in tiers and "ran stock" in _notes(handle, f"model.layers.{i}"), report
    _restored(model, handle, ids, ref)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("given", [False, True], ids=["created", "given"])
@torch.no_grad()
def test_prefill_into_an_empty_dynamic_cache_then_decode(name, given):
    """Each layer streams the call its own way (from its graph where the capture takes a cache, else its parts); the
    cache holds what stock's holds, and the next decoding step (stock: one token) reads it to the same logits."""
    model, ids = _lm(name), _ids()
    cache = lambda: {CACHE: transformers.DynamicCache(config=model.config)} if given else {}  # noqa: E731
    ref = model(ids, use_cache=True, **cache())
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, use_cache=True, **cache())
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    assert _streamed(handle, "model"), handle.report()
    nxt = _ids(n=1)
    step = model(nxt, use_cache=True, **{CACHE: _cache_of(out)})
    handle.remove()
    step_ref = model(nxt, use_cache=True, **{CACHE: _cache_of(ref)})
    assert rel_err(step.logits, step_ref.logits) <= 1e-5
    _same_cache(_cache_of(step), _cache_of(step_ref))


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
@torch.no_grad()
def test_padding_mask_batch_two(name):
    """transformers builds the padded batch's mask as [B, 1, N, N]; streamed, each layer gets it described and builds
    a Q chunk's rows at a time (tests/test_row_masks.py has every family). Logits of every real token and the cache
    match stock."""
    model, ids = _lm(name), _ids()
    mask = torch.ones_like(ids)
    mask[0, :9] = 0          # left padding
    mask[1, N - 13:] = 0     # right padding
    ref = model(ids, attention_mask=mask, use_cache=True)
    ref_nc = model(ids, attention_mask=mask, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, attention_mask=mask, use_cache=True)
    out_nc = model(ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    assert rel_err(out.logits[keep], ref.logits[keep]) <= 1e-5
    assert rel_err(out_nc[keep], ref_nc[keep]) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    assert _streamed(handle, "model"), handle.report()
    for i in range(2):   # each layer streamed the padded calls from its graph (with its cache and without: planned
        assert _tiers(handle, f"model.layers.{i}") == ["L1", "L1"], handle.report()   # apart)
    handle.remove()


@torch.no_grad()
def test_gemma2_padded_batch_two_with_cache():
    """Gemma 2 (eager attention, soft-capped: found in its layers' graphs; tests/test_row_masks.py), batch 2 padded
    left and right, its sliding layers' window shorter than the sequence: the streamed model forward's logits and
    cache (full and sliding layers) match stock's."""
    model, ids = _lm("gemma2", attn_logit_softcapping=50.0), _ids()
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    mask[1, N - 13:] = 0
    ref = model(ids, attention_mask=mask, use_cache=True)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, attention_mask=mask, use_cache=True)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    assert _streamed(handle, "model"), handle.report()
    handle.remove()


@torch.no_grad()
def test_generate_with_padding_gives_stock_tokens():
    model = _lm("llama")
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    assert _tiers(handle, "model")[0] == "L1"
    assert "a decoding step" in _notes(handle, "model"), handle.report()
    handle.remove()


@pytest.mark.parametrize("keep", [1, 5, 0, "tensor"])
@torch.no_grad()
def test_logits_to_keep(keep):
    model, ids = _lm("gemma3", final_logit_softcapping=2.0), _ids()   # soft-capped logits: in place here
    model.lm_head.weight.mul_(50)   # logits of a few units: where soft-capping bends them
    keep = torch.tensor([0, 7, 150, -1, 7]) if keep == "tensor" else keep
    ref = model(ids, use_cache=False, logits_to_keep=keep).logits
    handle = streamplan.apply(model, chunk_tokens=3)   # the final norm in 3-row chunks
    out = model(ids, use_cache=False, logits_to_keep=keep).logits
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5
    assert _tiers(handle, "") == ["L1"]
    handle.remove()


@torch.no_grad()
def test_calls_the_head_cannot_take_run_stock_with_the_reason():
    model, ids = _lm("llama"), _ids()
    rows = torch.tensor([[1, 2], [3, 4]])
    labels = _ids()
    ref_rows = model(ids, use_cache=False, logits_to_keep=rows).logits
    ref_loss = model(ids, use_cache=False, labels=labels).loss
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    assert torch.equal(model(ids, use_cache=False, logits_to_keep=rows).logits, ref_rows)
    assert rel_err(model(ids, use_cache=False, labels=labels).loss, ref_loss) <= 1e-5
    notes = _notes(handle, "")
    assert "logits_to_keep is not an int or a 1-D tensor" in notes and "labels are given" in notes
    assert _tiers(handle, "model") == ["L1"]   # the model under the stock head still streams
    handle.remove()


@torch.no_grad()
def test_return_dict_false_and_inputs_embeds():
    model, ids = _lm("qwen2"), _ids()
    embeds = model.model.embed_tokens(ids)
    before = embeds.clone()
    ref = model(inputs_embeds=embeds, use_cache=False, return_dict=False)
    base_ref = model.model(ids, use_cache=False, return_dict=False)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(inputs_embeds=embeds, use_cache=False, return_dict=False)
    base = model.model(ids, use_cache=False, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref) and rel_err(out[0], ref[0]) <= 1e-5
    assert isinstance(base, tuple) and len(base) == len(base_ref) and rel_err(base[0], base_ref[0]) <= 1e-5
    assert torch.equal(embeds, before)   # the caller's embeddings are not the residual
    assert _streamed(handle, "model"), handle.report()
    handle.remove()


@torch.no_grad()
@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers' offloaded cache moves layers to and from CUDA")
def test_offloaded_cache_prefill():
    model, ids = _lm("llama").cuda(), _ids().cuda()
    cache = lambda: {CACHE: transformers.DynamicCache(config=model.config, offloading=True)}  # noqa: E731
    ref = model(ids, use_cache=True, **cache())
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, use_cache=True, **cache())
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    assert _streamed(handle, "model"), handle.report()
    handle.remove()


def _same_fp8(a, b) -> None:
    """Two fp8 caches (transformers' Fp8QuantizedLayer: codes and a per-tensor scale) of K/V equal to 1e-5 in fp32:
    the scales equal to 1e-5; a code may differ by one fp8 step where its input sat on a rounding boundary (the
    streamed K/V are computed a chunk of rows at a time), and few do."""
    for la, lb in zip(a.layers, b.layers):
        for (qa, sa), (qb, sb) in ((la._quantized_keys, lb._quantized_keys),
                                   (la._quantized_values, lb._quantized_values)):
            assert qa.shape == qb.shape and rel_err(sa, sb) <= 1e-5
            ca, cb = qa.float(), qb.float()
            step = torch.maximum(ca.abs().maximum(cb.abs()) * 2 ** -3, torch.full_like(ca, 2 ** -9))
            assert ((ca - cb).abs() <= step).all()
            assert (ca != cb).float().mean() <= 1e-3


# generate's cache_implementation -> its extra arguments (the offloaded cache moves layers to and from CUDA)
GENERATE_CACHES = {"dynamic": {}, "quantized": {"cache_config": {"backend": "fp8"}}, "offloaded": {}}


@pytest.mark.parametrize("impl", sorted(GENERATE_CACHES))
@torch.no_grad()
def test_generate_gives_stock_tokens_logits_and_cache(impl):
    """``generate`` with a padded batch of 2 into each of transformers' cache kinds: the prefill streams (the model
    forward and every layer from its graph, filling the cache from the graph's K/V), the decoding steps run stock on
    that cache; tokens, every step's logits and the cache at the end match stock's."""
    if impl == "offloaded" and not torch.cuda.is_available():
        pytest.skip("transformers' offloaded cache moves layers to and from CUDA")
    device = "cuda" if impl == "offloaded" else "cpu"
    model, ids = _lm("llama").to(device), _ids().to(device)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation=impl, return_dict_in_generate=True, output_logits=True, **GENERATE_CACHES[impl])
    ref = model.generate(ids, **kw)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    # the prefill's logits need no quantized K/V (the first update hands back what it is given); the steps after it
    # read the fp8 cache, where a code one step apart moves a logit by about 1e-4 of the largest
    tol = [1e-5] + [1e-5 if impl != "quantized" else 1e-3] * (len(ref.logits) - 1)
    for step, (a, b, t) in enumerate(zip(out.logits, ref.logits, tol)):
        assert rel_err(a, b) <= t, (step, rel_err(a, b))
    (_same_fp8 if impl == "quantized" else _same_cache)(_cache_of(out), _cache_of(ref))
    assert _tiers(handle, "model")[0] == "L1" and "a decoding step" in _notes(handle, "model"), handle.report()
    for i in range(2):   # the prefill call of each layer streamed from its graph
        assert _tiers(handle, f"model.layers.{i}")[0] == "L1", handle.report()
    handle.remove()


@torch.no_grad()
def test_quantized_cache_prefill():
    try:
        transformers.QuantizedCache("fp8", _lm("llama").config)
    except (ValueError, TypeError, ImportError) as exc:
        pytest.skip(f"this transformers has no fp8 QuantizedCache: {exc}")
    model, ids = _lm("llama"), _ids()
    ref = model(ids, use_cache=True, **{CACHE: transformers.QuantizedCache("fp8", model.config)})
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out_cache = transformers.QuantizedCache("fp8", model.config)
    out = model(ids, use_cache=True, **{CACHE: out_cache})
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _same_fp8(out_cache, _cache_of(ref))
    assert _streamed(handle, "model"), handle.report()
    for i in range(2):   # each layer streamed from its graph and filled its empty fp8 layer from the graph's K/V
        assert _tiers(handle, f"model.layers.{i}") == ["L1"], handle.report()
    handle.remove()


@torch.no_grad()
def test_sliding_window_within_and_past_the_window():
    """Within the window transformers hands no mask; past it the banded mask reaches the layers described, and
    each Q chunk's rows are built against the window's keys alone: every layer streams both calls."""
    model = _lm("mistral", sliding_window=WINDOW)
    short, long = _ids(n=WINDOW - 2), _ids()
    ref_short, ref_long = (model(x, use_cache=False).logits for x in (short, long))
    handle = streamplan.apply(model, chunk_tokens=8)
    assert rel_err(model(short, use_cache=False).logits, ref_short) <= 1e-5
    assert _tiers(handle, "model.layers.0") == ["L1"]
    assert rel_err(model(long, use_cache=False).logits, ref_long) <= 1e-5
    assert _tiers(handle, "model.layers.0") == ["L1", "L1"], handle.report()
    assert "sliding window of 32" in _notes(handle, "model.layers.0"), handle.report()
    assert _streamed(handle, "model"), handle.report()
    handle.remove()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@torch.no_grad()
def test_peak_is_near_the_floor(name):
    """A prefill without cache (logits_to_keep=1) holds the residual, one layer's K and V, the rotary tables (a
    quarter of the floor at this width, 4% at Llama-3-8B's) and one chunk's transients; stock holds several
    residuals at once (the embeddings, each layer's input and output, the final norm's float32 copies)."""
    n, chunk = 8192, 128
    model, ids = _lm(name), _ids(batch=1, n=n)
    call = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref, stock_peak = streamplan.measure_peak(call)
    handle = streamplan.apply(model, chunk_tokens=chunk)
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    floor = n * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 4        # residual + K + V, float32
    rope = n * 2 * HEAD_DIM * 4 + n * 8                      # cos, sin and the position ids
    # one 128-row chunk of a 64-wide layer's transients: an eighth of the floor here (a few percent at real widths);
    # a second residual (a layer's output beside its input, or the embeddings kept) would be half the floor more
    assert peak <= floor + rope + floor / 4, (peak / floor, stock_peak / floor)
    assert stock_peak > 3 * peak, (peak / floor, stock_peak / floor)
    handle.remove()


@torch.no_grad()
def test_prefill_peak_with_a_cache_is_the_cache_and_the_residual():
    """Prefill into a DynamicCache: each layer's K and V stay, in the cache; beyond it only the residual and, while a
    layer fills the cache, its K and V once more (transformers' DynamicLayer copies what it is given)."""
    n, chunk = 8192, 128
    model, ids = _lm("llama"), _ids(batch=1, n=n)
    call = lambda: model(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
    ref, stock_peak = streamplan.measure_peak(call)
    handle = streamplan.apply(model, chunk_tokens=chunk)
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    residual, cache = n * HIDDEN * 4, 2 * n * 2 * KV_HEADS * HEAD_DIM * 4     # two layers' K and V, float32
    rope = n * 2 * HEAD_DIM * 4 + n * 8
    kv = n * 2 * KV_HEADS * HEAD_DIM * 4
    assert peak <= residual + cache + kv + rope + residual / 4, (peak / residual, stock_peak / residual)
    assert stock_peak > 2 * peak
    handle.remove()


@torch.no_grad()
def test_forward_of_another_version_stays_stock(monkeypatch):
    monkeypatch.setitem(decoders.FORWARDS, "LlamaModel", {"0000": "0.0"})
    model, ids = _lm("llama"), _ids()
    ref = model(ids, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, use_cache=False).logits
    report = handle.report()
    assert "model forward left stock" in report and "differs from the transformers versions" in report, report
    assert rel_err(out, ref) <= 1e-5
    assert _tiers(handle, "model.layers.0") == ["L1"]   # the layers still stream, from their graphs
    assert _tiers(handle, "") == ["L1"]                 # and the head, which calls the (stock) model
    _restored(model, handle, ids, ref)


@torch.no_grad()
def test_output_flags_keep_the_model_forward_stock():
    model, ids = _lm("llama"), _ids()
    # asking for hidden states once installs transformers' capturing hooks for good: the reference runs on a copy
    ref = copy.deepcopy(model)(ids, use_cache=False, output_hidden_states=True)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, use_cache=False, output_hidden_states=True)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert "output_hidden_states asks for every layer's hidden states" in _notes(handle, "model"), handle.report()
    assert "has forward hooks" in " ".join(s.reason for s in streamplan.apply(model).skipped)   # they stay
    handle.remove()


@torch.no_grad()
def test_a_hook_added_after_apply_keeps_the_model_forward_stock():
    model, ids = _lm("llama"), _ids()
    ref = model(ids, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    seen = []
    hook = model.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        out = model(ids, use_cache=False).logits
    finally:
        hook.remove()
    assert rel_err(out, ref) <= 1e-5 and len(seen) == 1
    assert "layers.1 has forward hooks" in _notes(handle, "model"), handle.report()
    assert not any(p.rows == CHUNK for p in handle.plans["model.norm"])   # stock: the final norm on every row
    assert rel_err(model(ids, use_cache=False).logits, ref) <= 1e-5
    assert any(p.rows == CHUNK for p in handle.plans["model.norm"])       # streamed again: in row chunks
    handle.remove()


def test_known_forwards_are_the_installed_ones():
    """Each followed class's forward at the installed transformers is one of the fingerprints (a new pin must be
    read and added, or its models stay stock)."""
    from streamplan.recognize.checks import source_fingerprint
    if transformers.__version__ not in decoders.CACHE_NAME:
        pytest.skip(f"transformers {transformers.__version__} is not a version streamplan follows")
    for cls_name, known in decoders.FORWARDS.items():
        family = (decoders.MODELS.get(cls_name) or decoders.LMS[cls_name]).module
        cls = getattr(__import__(f"transformers.models.{family}.modeling_{family}", fromlist=[cls_name]), cls_name)
        assert known.get(source_fingerprint(cls.forward)) == transformers.__version__, cls_name


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@torch.no_grad()
def test_feature_sliced_mlps_in_the_whole_model_are_exact(name):
    """L2 inside the streamed model forward: each layer's MLP hidden a slice of features at a time (its graph's
    linear -> elementwise -> linear region), padded batch of 2 with its mask rows per Q chunk, exact."""
    model, ids = _lm(name), _ids()
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK, ffn_slice=32)
    out = model(ids, attention_mask=mask, use_cache=False).logits
    assert rel_err(out, ref) <= 1e-5
    for i in range(2):
        plans = handle.plans[f"model.layers.{i}"]
        assert [p.tier for p in plans] == ["L2"] and plans[0].ffn_slice == 32, handle.report()
    handle.remove()


@torch.no_grad()
def test_llama3_8b_width_layer_plans_large_sliced_chunks_at_1_15x_the_floor(monkeypatch):
    """The planner's memory model at the H200 case of benchmarks/gpu_llm.py (one Llama-3-8B-width layer inside the
    streamed model: residual donated, 131,072 tokens, bf16, the model's budget 1.15x the floor), on meta tensors:
    row chunks alone fit 1,280 rows (the MLP's [chunk, 14336] hidden, gate, up and product); slicing the hidden
    (L2) fits more than twice that, above the GEMM utilisation floor. Plans chosen by memory alone (no rates: the
    time model may prefer a causal host store at this length, which reads half its blocks a pass)."""
    from streamplan.execute.donation import donate
    from streamplan.tools.families import FAMILIES, on_meta
    from streamplan.plan import time_model
    from streamplan.plan.planner import UTILISATION_FLOOR
    monkeypatch.delitem(time_model.RATES, "meta")
    n = 131072
    floor = (4096 + 2 * 8 * 128) * 2
    layer, inputs = on_meta(FAMILIES["llama3-8b-layer"], n, torch.bfloat16)
    handle = streamplan.apply(layer, budget=int(1.15 * floor * n))
    with donate(inputs[0]):
        layer(*inputs)
    (plan,) = handle.plans[""]
    assert plan.tier == "L2" and plan.ffn_slice <= 4096, plan.describe()
    assert plan.chunk >= max(UTILISATION_FLOOR["meta"], 2 * 1280), plan.describe()
    assert plan.predicted_total <= 1.15 * floor * n
    handle.remove()


@torch.no_grad()
def test_model_row_loops_take_the_layers_chunk_under_a_budget(monkeypatch):
    """Under a budget the model's own row loops (the final norm over every row) take its layers' smallest planned
    chunk. A causal LM nests two model forwards; the outer one's plan has no chunk of its own, and once counted as
    the smallest it sent the norm through the sequence one row at a time (131,072 Python steps per call on the H200:
    13 s of a 25 s prefill)."""
    n = 2048
    model, ids = _lm("llama"), _ids(batch=1, n=n)
    call = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref = call()
    floor = n * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 4
    handle = streamplan.apply(model, budget=ids.numel() * 8 + n * HIDDEN * 4 + int(1.5 * floor))
    loops = []
    real = decoders.for_chunks
    from streamplan.execute.call_state import rehearsing   # the forward's rehearsal runs its loops too, on fakes
    monkeypatch.setattr(decoders, "for_chunks", lambda rows, chunk, work: (
        None if rehearsing() else loops.append((rows, chunk)), real(rows, chunk, work)))
    out = call()
    assert rel_err(out.logits, ref.logits) <= 1e-5
    layer_chunks = {p.chunk for i in range(2) for p in handle.plans[f"model.layers.{i}"] if p.tier != "L0"}
    assert layer_chunks and max(layer_chunks) < n, layer_chunks          # the budget made the layers stream
    assert loops == [(n, min(layer_chunks))], (loops, layer_chunks)
    handle.remove()
