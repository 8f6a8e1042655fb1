"""Cache objects a block only reads (``graph/cache_views.py``): diffusers' per-layer K/V caches on their cached steps
stream from the captured graph, exact against the block's own forward (fp32, CPU), the cache left as it was; a call
that fills its cache keeps its stock forward, named, and fills it as stock does."""
import pytest
import torch

from conftest import rel_err, streamed  # noqa: E402

CPU = torch.device("cpu")
pytest.importorskip("diffusers")

from streamplan.tools.catalogue.diffusers_cases import CASES  # noqa: E402

T = "diffusers.models.transformers."


def _snapshot(cache) -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(cache).items()}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list):
            if len(x) != len(y) or any(p is not q for p, q in zip(x, y)):
                return False
        elif x is not y:
            return False
    return True


def _cache_arg(args, kwargs):
    from streamplan.registries import READ_CACHES
    for v in (*args, *kwargs.values()):
        if f"{type(v).__module__}:{type(v).__qualname__}" in READ_CACHES:
            return v
    raise AssertionError("the case passes no declared cache")


@torch.no_grad()
@pytest.mark.parametrize("case_name", ["glm_image", "qwenimage21", "sana_wm_refiner"])
def test_a_cache_the_block_only_reads_streams_exactly_and_is_left_as_it_was(case_name):
    case = CASES[case_name]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(400, CPU, torch.float32)
    ref = block(*args, **kwargs)
    cache = _cache_arg(args, kwargs)
    before = _snapshot(cache)
    with streamed(block, chunk_tokens=64) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1", handle.report()
    ref, out = (ref[0], out[0]) if isinstance(ref, tuple) else (ref, out)
    assert rel_err(out, ref) <= 1e-5
    assert type(cache).__module__.startswith("diffusers") and _same(_snapshot(cache), before)


def _glm(mode: str | None, stored: bool):
    case = CASES["glm_image"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(400, CPU, torch.float32)
    cache = kwargs["kv_cache"]
    if stored:   # a condition image's K/V, as the pipeline's first pass writes it: [1, tokens, heads, head_dim]
        cache.store(torch.randn(1, 24, 4, 16), torch.randn(1, 24, 4, 16))
    cache.mode = mode
    return block, args, kwargs, cache


@torch.no_grad()
def test_glm_image_reading_its_condition_images_cache_streams_exactly():
    block, args, kwargs, cache = _glm("read", stored=True)
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=64) as handle:
        out = block(*args, **kwargs)
        assert handle.plans[""][0].tier == "L1", handle.report()
    assert rel_err(out[0], ref[0]) <= 1e-5
    assert len(cache.k_caches) == 1 and cache.k_caches[0].shape[1] == 24


@torch.no_grad()
def test_a_call_that_fills_its_cache_runs_stock_named_and_fills_it_as_stock_does():
    block, args, kwargs, cache = _glm("write", stored=False)
    ref = block(*args, **kwargs)
    stock_k = cache.k_caches[0].clone()
    cache.k_caches.clear()
    cache.v_caches.clear()
    with streamed(block, chunk_tokens=64) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
    assert "a cache being filled" in report and "GlmImageLayerKVCache" in report, report
    assert torch.equal(out[0], ref[0])
    assert len(cache.k_caches) == 1 and torch.equal(cache.k_caches[0], stock_k)


@torch.no_grad()
def test_qwenimage21_extract_step_runs_stock_and_the_cached_step_after_it_streams():
    case = CASES["qwenimage21"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(400, CPU, torch.float32)
    cache = kwargs["layer_cache"]
    with streamed(block, chunk_tokens=64) as handle:
        extract = dict(kwargs, kv_cache_mode="extract")
        before = cache.k
        block(*args, **extract)
        assert cache.k is before   # no write slice given: extract leaves the cache alone, and that streams
        assert handle.plans[""][0].tier == "L1", handle.report()
        ref_k = cache.k
        out = block(*args, **kwargs)
        assert cache.k is ref_k
    ref = block(*args, **kwargs)
    assert rel_err(out[1] if isinstance(out, tuple) else out, ref[1] if isinstance(ref, tuple) else ref) <= 1e-5


def test_a_cache_holding_something_other_than_tensors_keeps_the_block_stock_named():
    from streamplan.graph.cache_views import view_of

    class Odd:
        def __init__(self):
            self.k = torch.zeros(1)
            self.hook = object()

    assert "holds object in 'hook'" in view_of(Odd())


def test_a_view_refuses_writes_and_round_trips_through_pytree():
    from torch.utils import _pytree as pytree
    from streamplan.graph.cache_views import CacheView, CacheWritten, view_of
    from diffusers.models.transformers.transformer_glm_image import GlmImageLayerKVCache
    cache = GlmImageLayerKVCache()
    cache.store(torch.ones(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))
    cache.mode = "read"
    view = view_of(cache)
    assert isinstance(view, GlmImageLayerKVCache) and isinstance(view, CacheView)
    leaves, spec = pytree.tree_flatten(view)
    assert len(leaves) == 2 and leaves[0] is cache.k_caches[0]
    again = pytree.tree_unflatten(leaves, spec)
    assert type(again) is type(view) and again.mode == "read"
    with pytest.raises(CacheWritten):
        again.mode = "write"
    with pytest.raises(CacheWritten):
        again.store(torch.ones(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))
    assert type(cache) is GlmImageLayerKVCache and not pytree._is_leaf(view) and pytree._is_leaf(cache)
