"""A causal LM's prefill into transformers' offloading ``DynamicCache`` (``generate(...,
cache_implementation="offloaded")``) with its layers' K/V kept in host memory (L4): the cache takes the store's host
rows as they are (``integrations.transformers.offloaded_cache``), and the planner prices what each kind of cache holds
(``kv_tiers.cache_bytes``: a plain cache's copy on the device, an offloading cache's in host memory).

transformers 5.24's offloading ``Cache.update`` orders CUDA streams (``torch.cuda.default_stream``) whatever the
device, so the real library's offloaded cache runs on CUDA alone: the end-to-end checks against stock ``generate``
need a GPU and are skipped without one. On the CPU: which caches may take host rows (read off the real cache
objects), the store options and the planner's prices, a plain cache's copy priced against the meter on a real
layer, and an offloading cache on the CPU failing in streamplan exactly as in stock."""
import dataclasses
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import streamplan  # noqa: E402
from conftest import TINY_DECODER, rel_err, streamed  # noqa: E402
from streamplan.attention import SDPA  # noqa: E402
from streamplan.execute import kv_tiers  # noqa: E402
from streamplan.integrations.transformers.graph_calls import adapt_cache_call  # noqa: E402
from streamplan.integrations.transformers.offloaded_cache import host_fill_problem  # noqa: E402
from streamplan.plan.planner import KVOption, Tier, plan_graph  # noqa: E402
from streamplan.specs import AdaptedCall  # noqa: E402
from streamplan.tools.catalogue.transformers_cases import CASES  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
N, CHUNK = 200, 64
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else \
    "past_key_values"
NEEDS_CUDA = "transformers' offloading Cache.update orders CUDA streams (torch.cuda.default_stream) on any device"


def _lm(model_type: str, **over):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY_DECODER, **over})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():   # norms away from one, so a norm applied twice or not at all shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _ids(batch=2, n=N):
    return torch.randint(3, TINY_DECODER["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(n))


def _offloading(model):
    return transformers.DynamicCache(config=model.config, offloading=True)


def _layer_call(n=N):
    """The catalogue's Llama decoder layer and a prefill call of ``n`` rows (its cache given by the caller)."""
    case = CASES["llama"]
    torch.manual_seed(0)
    layer = case.build()
    args, kwargs = case.inputs(n, CPU, torch.float32)
    return layer, args, {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}


# -- which caches take host rows -------------------------------------------------------------------------------------

def test_an_offloading_dynamic_cache_takes_host_rows_where_its_code_is_followed():
    """Read off the real cache objects: an empty ``DynamicLayer`` of an offloading ``DynamicCache`` on CUDA, its
    update's code the 5.24 source streamplan retraces (the fingerprints are checked against the installed library);
    anything else keeps the fill from device K/V, said why."""
    cfg = _lm("llama").config
    assert host_fill_problem(transformers.DynamicCache(config=cfg, offloading=True), 0, CUDA) is None
    assert host_fill_problem(transformers.DynamicCache(offloading=True), 1, CUDA) is None   # layers made lazily
    assert "CUDA streams" in host_fill_problem(transformers.DynamicCache(config=cfg, offloading=True), 0, CPU)
    assert "not an offloading" in host_fill_problem(transformers.DynamicCache(config=cfg), 0, CUDA)
    sliding = transformers.AutoConfig.for_model("mistral", **{**TINY_DECODER, "sliding_window": 32})
    why = host_fill_problem(transformers.DynamicCache(config=sliding, offloading=True), 0, CUDA)
    assert "DynamicSlidingWindowLayer" in why
    started = transformers.DynamicCache(config=cfg, offloading=True)
    started.layers[0].lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    assert "already initialized" in host_fill_problem(started, 0, CUDA)


def test_the_adapted_call_says_where_its_cache_keeps_kv():
    layer, args, kwargs = _layer_call()
    cfg = _lm("llama").config
    plain = adapt_cache_call(layer, args, {**kwargs, "cache": transformers.DynamicCache(config=cfg)})
    assert plain.held == "device" and plain.host_fill is None and plain.host_problem == ""
    offloading = adapt_cache_call(layer, args, {**kwargs, "cache": transformers.DynamicCache(config=cfg,
                                                                                              offloading=True)})
    assert offloading.held == "host" and offloading.host_fill is None   # its tensors are on the CPU
    assert "CUDA streams" in offloading.host_problem
    assert all(v is None or not isinstance(v, transformers.DynamicCache) for v in offloading.kwargs.values())


# -- the stores a cache-filling call may use, and their prices ---------------------------------------------------------

def _adapted(held: str, host_fill=None, why: str = "") -> AdaptedCall:
    return AdaptedCall((), {}, 2, lambda k, v: None, held, host_fill, why)


def test_only_a_cache_that_takes_host_rows_lets_its_kv_leave_the_device():
    from streamplan.graph import streamable
    layer, args, kwargs = _layer_call()
    found, _ = streamable(layer, args, kwargs, N)
    kv_bytes = 2 * 1 * 2 * N * 16 * 4   # K and V: batch 1, 2 K/V heads, head_dim 16, fp32
    opts, why = kv_tiers.options_for(found, N, CPU, "host", SDPA, _adapted("device"))
    assert opts == () and "filled from the whole K/V" in why
    opts, why = kv_tiers.options_for(found, N, CPU, "host", SDPA, _adapted("host", why="its layer is odd"))
    assert opts == () and "offloading cache" in why and "its layer is odd" in why
    taker = _adapted("host", lambda k, v, device: None)
    (opt,), why = kv_tiers.options_for(found, N, CPU, "host", SDPA, taker)
    assert why is None and opt.kind == "host" and opt.groups == (1,)   # one view per K and V: one head group
    assert opt.fill == kv_bytes and opt.host_bytes == kv_bytes   # the prefetched layer: as large as this one's K/V
    (free,), _ = kv_tiers.options_for(found, N, CPU, "host", SDPA)
    assert free.fill == 0 and 2 in free.groups   # without a cache: head groups, nothing filled
    assert kv_tiers.options_for(found, N, CPU, "int8", SDPA, taker)[0] == ()   # a cache takes exact K/V
    (auto,), _ = kv_tiers.options_for(found, N, torch.device("meta"), "device", SDPA, taker)
    assert auto.kind == "host" and auto.groups == (1,)   # below the floor on a GPU: L4 weighed as without a cache


def test_cache_bytes_by_where_the_cache_keeps_kv():
    kv = 1000
    assert kv_tiers.cache_bytes(None, kv) == (0, 0)
    assert kv_tiers.cache_bytes(_adapted("device"), kv) == (kv, 0)        # its copy, on the device
    assert kv_tiers.cache_bytes(_adapted("host"), kv) == (2 * kv, kv)     # a copy moved to the host, a layer prefetched
    assert kv_tiers.cache_bytes(_adapted("host"), kv, stored=True) == (kv, 0)   # the store's rows: the prefetch alone


ROWS, KV, OUT = 8192, 80_000, 20_000
TRANSIENT = lambda c, sl: c * 4  # noqa: E731


def test_the_planner_prices_the_fill_after_phase_q():
    # a plain cache: its copy beside K/V still whole, once phase Q's transients are gone
    plain = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, chunk_tokens=1024, kv=KV, fill=KV)
    assert plain.predicted_peak == KV + OUT + max(1024 * 4, KV) and plain.host_bytes == 0
    small = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, chunk_tokens=1024, kv=KV, fill=100)
    assert small.predicted_peak == KV + OUT + 1024 * 4   # a fill smaller than a chunk's transient adds nothing
    # an offloading cache from device K/V: its copy and a prefetched layer on the device, its copy on the host
    offloaded = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, chunk_tokens=1024, kv=KV, fill=2 * KV, fill_host=KV)
    assert offloaded.predicted_peak == OUT + 3 * KV and offloaded.host_bytes == KV
    # the same cache filled from a host store: the prefetched layer alone, beside the outputs
    host = KVOption("host", Tier.L4, resident=0, block_row=8, merge_row=2, host_bytes=KV, fill=KV)
    stored = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, chunk_tokens=1024, kv=KV, fill=2 * KV, fill_host=KV,
                        kv_options=(host,), kv_store="host")
    assert stored.tier == Tier.L4 and stored.host_bytes == KV
    assert stored.predicted_peak == OUT + max(stored.kv_block * 8 + 1024 * 6, KV)


def test_under_a_budget_an_offloading_cache_buys_l4_where_its_device_fill_does_not_fit():
    host = KVOption("host", Tier.L4, resident=0, block_row=8, merge_row=2, host_bytes=KV, fill=KV)
    budget = OUT + KV + 2048 * 8 + 2048 * 6   # K/V whole and one chunk fit; with the fill's copy and prefetch not
    without = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, budget=budget, min_chunk=1024, kv=KV,
                         kv_options=(host,))
    assert without.tier == Tier.L1   # no cache to fill: K/V stay on the device
    plan = plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, budget=budget, min_chunk=1024, kv=KV, fill=2 * KV,
                      fill_host=KV, kv_options=(host,))
    assert plan.tier == Tier.L4 and plan.kv == "host" and plan.predicted_peak <= budget
    with pytest.raises(streamplan.BudgetError):   # a plain cache's copy belongs on the device: no store for it
        plan_graph(ROWS, KV + OUT, TRANSIENT, 10**9, budget=OUT + KV + 2048 * 4, min_chunk=1024, kv=KV, fill=KV)


# -- real layers and models on the CPU ---------------------------------------------------------------------------------

@torch.no_grad()
def test_a_plain_cache_is_filled_from_device_kv_and_its_copy_is_priced():
    """A plain ``DynamicCache`` keeps today's path under ``kv="host"`` (said in the report): K/V whole on the device,
    the cache filled with its own copy of them, which the plan prices (the meter agrees) and which stock holds too."""
    layer, args, kwargs = _layer_call(1024)
    ref_cache = transformers.DynamicCache()
    ref = layer(*args, **kwargs, cache=ref_cache, use_cache=True)
    with streamed(layer, chunk_tokens=128, capture="prefer", kv="host") as handle:
        layer(*args, **kwargs, cache=transformers.DynamicCache(), use_cache=True)   # captured and planned
        cache = transformers.DynamicCache()
        out, peak = streamplan.measure_peak(lambda: layer(*args, **kwargs, cache=cache, use_cache=True), device=CPU)
        (plan,) = handle.plans[""]
        report = handle.report()
    assert plan.tier == Tier.L1 and plan.kv == "device", report
    assert "kv=host not used: the call's cache is filled from the whole K/V" in report
    kv_bytes = 2 * 2 * 1024 * 16 * 4
    assert plan.predicted_peak >= peak and plan.predicted_peak >= 2 * kv_bytes, (plan.predicted_peak, peak)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(cache.layers[0].keys, ref_cache.layers[0].keys) <= 1e-5
    assert rel_err(cache.layers[0].values, ref_cache.layers[0].values) <= 1e-5


@torch.no_grad()
def test_a_call_with_a_cache_is_planned_apart_from_one_without():
    """A layer's plan made for the prefill without a cache (K/V staged to the host, nothing to fill) is not reused
    for the same shapes with one, whose cache then stayed empty: each is planned for what it fills (and a plain cache
    apart from an offloading one)."""
    model, ids = _lm("llama"), _ids()
    ref = model(ids, use_cache=True, **{CACHE: transformers.DynamicCache(config=model.config)})
    with streamed(model, chunk_tokens=CHUNK, kv="host") as handle:
        model(ids, use_cache=False)
        cache = transformers.DynamicCache(config=model.config)
        out = model(ids, use_cache=True, **{CACHE: cache})
        for i in range(2):
            assert [p.kv for p in handle.plans[f"model.layers.{i}"]] == ["host", "device"], handle.report()
    assert rel_err(out.logits, ref.logits) <= 1e-5
    for got, want in zip(cache.layers, _cache_of(ref).layers):
        assert got.get_seq_length() == N and rel_err(got.keys, want.keys) <= 1e-5
        assert rel_err(got.values, want.values) <= 1e-5


def _takes_host_rows(block, args, kwargs):
    """transformers' own adapter, its plain cache declared to take host rows as an offloading one does on CUDA: the
    layer initialized as ``DynamicLayer.update`` does (its device, then the K/V), holding the views it is given. On
    the CPU it stands in for the offloading cache's CUDA stream ordering; the rest of the path is what CUDA runs."""
    found = adapt_cache_call(block, args, kwargs)
    if not isinstance(found, AdaptedCall):
        return found
    cache = next(v for v in (*args, *kwargs.values()) if isinstance(v, transformers.DynamicCache))
    idx = next(m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int))

    def take(k, v, device):
        layer = cache.layers[idx]
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v

    return dataclasses.replace(found, held="host", host_fill=take)


@torch.no_grad()
def test_a_cache_taking_host_rows_holds_the_stores_buffers_and_decodes_as_stock(monkeypatch):
    """The whole path but the CUDA stream ordering, on the CPU (host rows in numpy's arena, apart from torch's
    allocator, which the meter watches): each layer streams at L4 in one head group, its cache layer is given views
    of the store's host rows (the store's layout, rows first, no copy), the logits and cache are stock's, a decoding
    step reads them to stock's logits, and the device side never holds a layer's K/V: the meter sees the prefill
    without the cache's copies that the plain path makes."""
    from streamplan import registries
    # PyTorch's CPU flash kernel holds tiles per thread: one thread, so the peaks compared differ by the caches alone
    # on any machine (on a 16-thread machine the host-rows run peaked 168 KB higher)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _host_rows_decode(monkeypatch, registries)
    finally:
        torch.set_num_threads(threads)


def _host_rows_decode(monkeypatch, registries):
    n = 1024
    model, ids = _lm("llama"), _ids(n=n)
    ref_cache = transformers.DynamicCache(config=model.config)
    ref = model(ids, use_cache=True, logits_to_keep=1, **{CACHE: ref_cache})
    kv_bytes = 2 * 2 * TINY_DECODER["num_key_value_heads"] * n * TINY_DECODER["head_dim"] * 4   # one layer's K and V

    def prefill(handle):
        model(ids, use_cache=True, logits_to_keep=1, **{CACHE: transformers.DynamicCache(config=model.config)})
        cache = transformers.DynamicCache(config=model.config)
        out, peak = streamplan.measure_peak(
            lambda: model(ids, use_cache=True, logits_to_keep=1, **{CACHE: cache}), device=CPU)
        return out, cache, peak

    with streamed(model, chunk_tokens=128, kv="host") as handle:
        _, _, plain = prefill(handle)   # a plain cache: K/V whole on the device, the cache's copy of them
        assert handle.plans["model.layers.0"][0].kv == "device", handle.report()
    monkeypatch.setattr(registries, "CALL_ADAPTERS", [_takes_host_rows, *registries.CALL_ADAPTERS])
    with streamed(model, chunk_tokens=128, kv="host") as handle:
        out, cache, peak = prefill(handle)
        for i in range(2):
            (plan,) = handle.plans[f"model.layers.{i}"]
            assert plan.tier == Tier.L4 and plan.kv == "host" and plan.head_groups == 1, handle.report()
        B, H, D = 2, TINY_DECODER["num_key_value_heads"], TINY_DECODER["head_dim"]
        for got, want in zip(cache.layers, ref_cache.layers):
            for t, r in ((got.keys, want.keys), (got.values, want.values)):
                assert t.shape == r.shape and rel_err(t, r) <= 1e-5
                # a view of the store's host rows [1 group, rows, B, Hkv, D], the whole of its buffer: not a copy
                assert t.stride() == (H * D, D, B * H * D, 1) and t.untyped_storage().nbytes() == t.numel() * 4
        nxt = _ids(n=1)
        step = model(nxt, use_cache=True, **{CACHE: cache})
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert peak <= plain - 2 * kv_bytes, (peak, plain, kv_bytes)   # both layers' copies left the device side
    step_ref = model(nxt, use_cache=True, **{CACHE: ref_cache})
    assert rel_err(step.logits, step_ref.logits) <= 1e-5


@torch.no_grad()
def test_an_offloading_cache_on_the_cpu_fails_as_in_stock_under_a_budget_too():
    """No oracle runs an offloading cache on the CPU (its update asks for CUDA streams): streamplan raises what stock
    raises. Under a budget the whole forward is not rehearsed (its copy of the cache cannot copy a stream), said."""
    model, ids = _lm("llama"), _ids()
    with pytest.raises(Exception) as stock:
        model(ids, use_cache=True, **{CACHE: _offloading(model)})
    with streamed(model, budget="1GB", kv="host") as handle:
        with pytest.raises(type(stock.value)) as got:
            model(ids, use_cache=True, **{CACHE: _offloading(model)})
        report = handle.report()
    assert str(got.value) == str(stock.value)
    assert "cannot be copied" in report, report


# -- end to end against stock generate (CUDA) --------------------------------------------------------------------------

def _same_layers(a, b) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.is_initialized and lb.is_initialized and la.device == lb.device
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
            assert x.is_pinned() == y.is_pinned()
            assert rel_err(x, y) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.no_grad()
def test_prefill_fills_the_offloaded_cache_from_the_host_rows(model_type):
    """Every layer streams its prefill with K/V in host memory (L4, forced) and its offloaded cache layer takes the
    store's pinned host rows as they are: the logits, and each layer's state (device, K/V values, where they lie,
    pinned), are stock's; a layer the cache left in host memory holds a view of the store's buffer, not a copy; and
    the next decoding step reads the cache to stock's logits."""
    model, ids = _lm(model_type, num_hidden_layers=3).cuda(), _ids().cuda()
    ref_cache = _offloading(model)
    ref = model(ids, use_cache=True, **{CACHE: ref_cache})
    with streamed(model, chunk_tokens=CHUNK, kv="host") as handle:
        cache = _offloading(model)
        out = model(ids, use_cache=True, **{CACHE: cache})
        torch.cuda.synchronize()
        for i in range(3):
            (plan,) = handle.plans[f"model.layers.{i}"]
            assert plan.tier == Tier.L4 and plan.kv == "host" and plan.head_groups == 1, handle.report()
        assert rel_err(out.logits, ref.logits) <= 1e-5
        _same_layers(cache, ref_cache)
        B, H, D = 2, TINY_DECODER["num_key_value_heads"], TINY_DECODER["head_dim"]
        on_host = [layer for layer in cache.layers if layer.keys.device.type == "cpu"]
        assert len(on_host) == 2   # stock's update prefetched layer 0 to the device at the last layer, as here
        for layer in on_host:
            for t in (layer.keys, layer.values):   # the L4 store's rows [groups, rows, B, Hkv, D], viewed
                assert t._base is not None and tuple(t._base.shape) == (1, N, B, H, D) and t._base.is_pinned()
        nxt = _ids(n=1).cuda()
        step = model(nxt, use_cache=True, **{CACHE: cache})
    step_ref = model(nxt, use_cache=True, **{CACHE: ref_cache})
    torch.cuda.synchronize()
    assert rel_err(step.logits, step_ref.logits) <= 1e-5
    _same_layers(cache, ref_cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.no_grad()
def test_generate_with_an_offloaded_cache_from_host_staged_kv_gives_stock_tokens(model_type):
    """``generate(cache_implementation="offloaded")``: the prefill streams every layer at L4 into the cache, the
    decoding steps run stock on it; tokens, the prefill's and every step's logits, and the cache at the end are
    stock's."""
    model, ids = _lm(model_type, num_hidden_layers=3).cuda(), _ids().cuda()
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="offloaded",
              return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, **kw)
    with streamed(model, chunk_tokens=CHUNK, kv="host") as handle:
        out = model.generate(ids, **kw)
        for i in range(3):
            assert handle.plans[f"model.layers.{i}"][0].kv == "host", handle.report()
    torch.cuda.synchronize()
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert rel_err(a, b) <= 1e-5, (step, rel_err(a, b))
    _same_layers(_cache_of(out), _cache_of(ref))


def _cache_of(out):
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values


# -- reference runs that need a copy of the cache ----------------------------------------------------------------------

def test_self_check_and_verify_say_an_offloading_cache_cannot_be_copied():
    """``self_check`` and ``verify`` run stock on private copies of a call's inputs; an offloading cache holds CUDA
    streams and cannot be copied. The self-check is not run, said in the report (the call then fails on the CPU as
    stock does, not on the copy); ``verify`` refuses before either run, naming the fix."""
    model, ids = _lm("llama"), _ids()
    with pytest.raises(Exception) as stock:
        model(ids, use_cache=True, **{CACHE: _offloading(model)})
    with streamed(model, chunk_tokens=CHUNK, self_check=True) as handle:
        with pytest.raises(type(stock.value)) as got:
            model(ids, use_cache=True, **{CACHE: _offloading(model)})
        report = handle.report()
    assert str(got.value) == str(stock.value)
    assert "self-check not run: the call's DynamicCache cannot be copied for a stock reference run" in report, report
    with pytest.raises(ValueError, match="verify: the call's DynamicCache cannot be copied.*a plain DynamicCache"):
        streamplan.verify(model, ids, use_cache=True, **{CACHE: _offloading(model)})
