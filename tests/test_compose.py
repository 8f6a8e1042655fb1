"""streamplan among what users already turn on (issue 13): diffusers hooks (group offloading, layerwise casting,
the cache configs of the pinned diffusers), accelerate's sequential offload, peft LoRA, torchao and bitsandbytes
weights, compile, checked against the same configuration without streamplan, on the real diffusers model."""
import pytest
import torch
from diffusers.hooks import (FasterCacheConfig, HookRegistry, ModelHook,
                             PyramidAttentionBroadcastConfig, apply_faster_cache, apply_pyramid_attention_broadcast)

import streamplan
import compose_setups as setups
from conftest import is_block, rel_err
import streamplan.execute.hook_chains
import streamplan.plan.weight_formats
from streamplan.specs import STREAMED_MARK

BLOCKS = {"blocks.0", "blocks.1", "blocks.2"}


CONFIGS = {"block_level": setups.block_level, "leaf_level": setups.leaf_level, "layerwise_casting": setups.casting,
           "first_block_cache": setups.first_block_cache}


def _inner_links(model):
    """Every function the modules' diffusers hook chains end in."""
    links = []
    for m in model.modules():
        reg = m.__dict__.get("_diffusers_hook")
        for ref in getattr(reg, "_fn_refs", ()):
            links += [ref.forward, ref.original_forward]
    return links


def _hook_orders(model):
    return {n: list(m._diffusers_hook._hook_order) for n, m in model.named_modules()
            if getattr(getattr(m, "_diffusers_hook", None), "_hook_order", None)}


def _streamed(handle):
    """The blocks (not the parts a stock block streams from their own graphs) that streamed from their graph."""
    return {n for n, e in handle.installed.items() if isinstance(e.spec, streamplan.specs.GraphSpec)
            and is_block(n) and any(p.tier == "L1" for p in e.plans.values())}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_streams_inside_diffusers_hooks(config):
    torch.manual_seed(0)
    model = setups.wan_model()
    CONFIGS[config](model)
    hooks_before = _hook_orders(model)
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    handle = streamplan.apply(model, chunk_tokens=256)
    out, peak = streamplan.measure_peak(setups.steps, model)
    report = handle.report()
    assert _streamed(handle) == BLOCKS, report
    assert "" in handle.installed, report   # the model forward too (inside the root's hooks where it has any)
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= 1e-5, report
    assert peak < 0.75 * ref_peak, (peak, ref_peak, report)
    handle.remove()
    assert not any(getattr(f, STREAMED_MARK, False) for f in _inner_links(model))
    assert _hook_orders(model) == hooks_before   # the user's hooks stay, in their order
    again = setups.steps(model)
    assert all(torch.equal(a, r) for a, r in zip(again, ref))


@pytest.mark.parametrize("config", ["block_level", "leaf_level", "layerwise_casting"])
def test_peak_as_low_as_without_the_hook(config):
    """Once captured, a streamed call inside the weight hooks peaks within 10% of the same model streamed without
    them; layerwise casting may add one block's weights in the compute dtype (held for the streamed call, where
    stock casts one leaf at a time)."""
    peaks, allowance = [], 0
    for hooked in (False, True):
        torch.manual_seed(0)
        model = setups.wan_model()
        if hooked:
            CONFIGS[config](model)
            if config == "layerwise_casting":
                allowance = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        streamplan.apply(model, chunk_tokens=256)
        setups.steps(model)   # the capture, outside the measurement
        peaks.append(streamplan.measure_peak(setups.steps, model)[1])
    assert peaks[1] <= 1.1 * peaks[0] + allowance, (peaks, allowance)


def test_first_block_cache_skips_streamed_blocks():
    """The cache decides whether a block runs: on the second call the tail blocks are skipped, streamed or not."""
    model = setups.wan_model()
    setups.first_block_cache(model)
    handle = streamplan.apply(model, chunk_tokens=256)
    calls = {n: 0 for n in BLOCKS}
    for n in BLOCKS:
        entry = handle.installed[n]
        run = entry.wrapper

        def counted(*a, _run=run, _n=n, **kw):
            calls[_n] += 1
            return _run(*a, **kw)
        assert streamplan.execute.hook_chains.uninstall(entry.module, run, counted)
    setups.steps(model)
    assert calls == {"blocks.0": 2, "blocks.1": 1, "blocks.2": 1}


def test_hooks_added_after_apply_wrap_the_streamed_forward():
    torch.manual_seed(0)
    model = setups.wan_model()
    handle = streamplan.apply(model, chunk_tokens=256)
    setups.block_level(model)   # diffusers wraps whatever forward it finds: streamplan's, which stays innermost
    ref_model = setups.wan_model()
    ref_model.load_state_dict(model.state_dict())
    setups.block_level(ref_model)
    out, ref = setups.steps(model), setups.steps(ref_model)
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert _streamed(handle) == BLOCKS, handle.report()
    handle.remove()
    assert not any(getattr(f, STREAMED_MARK, False) for f in _inner_links(model))
    assert "group_offloading" in model.blocks[0]._diffusers_hook.hooks
    assert all(torch.equal(a, r) for a, r in zip(setups.steps(model), ref))


def test_removing_diffusers_hooks_after_apply_keeps_streaming():
    torch.manual_seed(0)
    model = setups.wan_model()
    ref = setups.steps(model)
    setups.first_block_cache(model)
    handle = streamplan.apply(model, chunk_tokens=256)
    for block in model.blocks:   # diffusers' own removal moves streamplan's link back to module.forward
        for name in list(block._diffusers_hook._hook_order):
            block._diffusers_hook.remove_hook(name)
    assert getattr(model.blocks[0].__dict__["forward"], STREAMED_MARK, False)
    out = setups.steps(model)
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__


class _Scale(ModelHook):
    """A user's own hook: streamplan cannot know what it does, so the block stays stock."""

    def post_forward(self, module, output):
        return output * 2


def test_unknown_hooks_keep_blocks_stock_with_the_reason():
    torch.manual_seed(0)
    model = setups.wan_model()
    HookRegistry.check_if_exists_or_initialize(model.blocks[1]).register_hook(_Scale(), "user_scale")
    # pyramid attention broadcast hooks the attentions inside each block: a graph would bypass its reuse of outputs
    apply_pyramid_attention_broadcast(model, PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_block_identifiers=("blocks.2",),
        current_timestep_callback=lambda: 500))
    ref = setups.steps(model)
    handle = streamplan.apply(model, chunk_tokens=256)
    report = handle.report()
    assert _streamed(handle) <= {"blocks.0"}
    assert "a diffusers hook streamplan does not know (user_scale: _Scale)" in report
    assert "PyramidAttentionBroadcastHook" in report
    out = setups.steps(model)
    assert _streamed(handle) == {"blocks.0"}, report
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))


@torch.no_grad()
def test_lora_adapters_trace_through_peft():
    """peft's LoRA layers are captured with the block (A, B and the scale in the graph); a block whose adapter state
    differs (its own scale, adapters disabled, merged) gets its own capture, never another state's graph."""
    torch.manual_seed(0)
    model, layers = setups.lora(setups.wan_model())   # block 1's adapters at their own scale
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    handle = streamplan.apply(model, chunk_tokens=256)
    out, peak = streamplan.measure_peak(setups.steps, model)
    assert _streamed(handle) == BLOCKS, handle.report()
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert peak < 0.75 * ref_peak, (peak, ref_peak)
    for change in (lambda m: m.enable_adapters(False), lambda m: (m.enable_adapters(True), m.merge())):
        for layer in layers:
            change(layer)
        with streamplan.api.bypass():   # the same model, stock forwards
            ref = setups.steps(model)
        out = setups.steps(model)
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref)), handle.report()
    assert _streamed(handle) == BLOCKS


@torch.no_grad()
def test_int8_weight_only_streams_exact():
    """torchao's int8 weight-only linears are captured with the block (dequantisation in the graph, per chunk)."""
    torch.manual_seed(0)
    model = setups.wan_model()
    setups.int8_weight_only(model)
    assert type(model.blocks[0].attn1.to_q.weight).__module__.startswith("torchao")
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    handle = streamplan.apply(model, chunk_tokens=256)
    out, peak = streamplan.measure_peak(setups.steps, model)
    assert _streamed(handle) == BLOCKS, handle.report()
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert peak < 0.75 * ref_peak, (peak, ref_peak)


def test_sequential_cpu_offload():
    """accelerate's sequential offload (enable_sequential_cpu_offload's cpu_offload): weights live on the meta device
    and each module's AlignDevicesHook loads its own for its call. The blocks stream inside their hooks, their leaves'
    weights loaded around the graph run; the model forward streams inside its two hooks (a SequentialHook: inputs
    moved, its own weights loaded), its row loops calling the leaves under their hooks."""
    torch.manual_seed(0)
    model = setups.wan_model()
    setups.sequential_offload(model)
    assert model.blocks[0].attn1.to_q.weight.device.type == "meta"
    ref, ref_peak = streamplan.measure_peak(setups.steps, model, device="cpu")
    handle = streamplan.apply(model, chunk_tokens=256)
    setups.steps(model)   # the capture, outside the measurement
    out, peak = streamplan.measure_peak(setups.steps, model, device="cpu")
    assert _streamed(handle) == BLOCKS, handle.report()
    assert handle.installed[""].plans and "runs inside hooks: accelerate 0: AlignDevicesHook, accelerate 1: " \
        "AlignDevicesHook" in handle.report(), handle.report()
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert peak < 0.6 * ref_peak, (peak, ref_peak)
    assert model.blocks[0].attn1.to_q.weight.device.type == "meta"   # offloaded again after the streamed call
    block = model.blocks[0]
    handle.remove()
    assert not getattr(block.__dict__["_old_forward"], STREAMED_MARK, False)
    assert all(torch.equal(a, r) for a, r in zip(setups.steps(model), ref))


def test_compiled_blocks_stay_stock_with_the_reason():
    """Regional compile (compile_repeated_blocks): a compiled block's calls run under dynamo, which would trace the
    streamed chunk loops, so the block stays stock, named; its parts called under compile run stock, noted."""
    torch.manual_seed(0)
    model = setups.wan_model()
    ref = setups.steps(model)
    model.compile_repeated_blocks(backend="eager")   # no C++ toolchain needed on CPU
    handle = streamplan.apply(model, chunk_tokens=256)
    out = setups.steps(model)
    report = handle.report()
    assert not _streamed(handle) and "blocks.0  (WanTransformerBlock): the module is compiled (torch.compile)" in report
    assert "called under torch.compile: ran stock" in report
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert "" in handle.installed and handle.installed[""].plans, report   # the model forward still streams its head


# --- the cache configs of the pinned diffusers (enable_cache's list): each streams when its block runs, or keeps the
# block stock with the reason. Several denoising steps, each in its cache context, the latent moved by the output.

BLOCK_CACHES = {   # config -> (apply, whether the model forward streams too)
    "mag_cache": (setups.mag_cache, True),
    "sea_cache": (setups.sea_cache, True),
    "taylorseer_blocks": (setups.taylorseer(cache_identifiers=[r"blocks\.\d+"]), True),
    # its order-0 factor is block 0's output itself: block 1 must not be handed it to overwrite
    "taylorseer_first_block": (setups.taylorseer(cache_identifiers=[r"blocks\.0"]), True),
    # lite: blocks skipped on predicted steps, proj_out predicted; the head calls proj_out per row chunk, so the
    # model forward stays stock, named
    "taylorseer_lite": (setups.taylorseer(use_lite_mode=True), False),
}


def _cached_beside_uncached(apply):
    """A tiny Wan model with a cache hook applied, and the same weights' denoising without the cache."""
    torch.manual_seed(0)
    model = setups.wan_model()
    plain = setups.wan_model()
    plain.load_state_dict(model.state_dict())
    apply(model)
    return model, setups.denoise(plain)


@pytest.mark.parametrize("config", list(BLOCK_CACHES))
def test_block_caches_stream_when_their_block_runs(config):
    apply, root = BLOCK_CACHES[config]
    model, no_cache = _cached_beside_uncached(apply)
    ref, ref_peak = streamplan.measure_peak(setups.denoise, model)
    assert any(rel_err(r, n) > 1e-3 for r, n in zip(ref, no_cache))   # the cache skipped or predicted something
    handle = streamplan.apply(model, chunk_tokens=256)
    out, peak = streamplan.measure_peak(setups.denoise, model)
    report = handle.report()
    assert _streamed(handle) == BLOCKS, report
    assert ("" in handle.installed) == root, report
    if not root:
        assert "proj_out: diffusers hook taylorseer_cache: TaylorSeerCacheHook decides per call" in report
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= 1e-5, report
    assert peak < ref_peak, (peak, ref_peak, report)
    if config == "mag_cache":   # removal gives the cached model back (once: each run is 4 steps)
        handle.remove()
        assert all(torch.equal(a, r) for a, r in zip(setups.denoise(model), ref))


PART_CACHES = {   # config -> (apply, the reason in the report)
    "pyramid_attention_broadcast": (setups.pyramid,
        "PyramidAttentionBroadcastHook: pyramid attention broadcast reuses attention outputs across steps; a captured "
        "graph fuses the attention with the rest of the block"),
    "taylorseer_attention": (setups.taylorseer(cache_identifiers=[r"blocks\.\d+\.attn1"]),
        "attn1: diffusers hook taylorseer_cache: TaylorSeerCacheHook decides per call whether this part runs"),
}


@pytest.mark.parametrize("config", list(PART_CACHES))
def test_caches_on_parts_keep_blocks_stock_with_the_reason(config):
    """A hook that replaces an attention's output by one kept from an earlier step cannot act inside a graph of the
    whole block: the block stays stock, named; its feed-forward part and the model forward still stream."""
    apply, reason = PART_CACHES[config]
    model, no_cache = _cached_beside_uncached(apply)
    ref = setups.denoise(model)
    assert any(rel_err(r, n) > 1e-3 for r, n in zip(ref, no_cache))
    handle = streamplan.apply(model, chunk_tokens=256)
    out = setups.denoise(model)
    report = handle.report()
    assert not _streamed(handle) and reason in report, report
    assert "" in handle.installed and "blocks.0.ffn" in handle.installed, report
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref)), report


def test_faster_cache():
    """FasterCache: its denoiser hook on the model (which may drop the unconditional half of the batch) has the
    streamed model forward inside it; its attention hooks keep the blocks stock, named."""
    torch.manual_seed(0)
    model = setups.wan_model()
    plain = setups.wan_model()
    plain.load_state_dict(model.state_dict())
    apply_faster_cache(model, FasterCacheConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
        unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 901),
        current_timestep_callback=lambda: setups.T[0], tensor_format="BCFHW",
        spatial_attention_block_identifiers=["blocks"],
        attention_weight_callback=lambda _: 0.5))
    no_cache = setups.denoise(plain, batch=2, kwargs=True)
    ref = setups.denoise(model, batch=2, kwargs=True)
    assert any(rel_err(r, n) > 1e-3 for r, n in zip(ref, no_cache))
    handle = streamplan.apply(model, chunk_tokens=256)
    out = setups.denoise(model, batch=2, kwargs=True)
    report = handle.report()
    assert not _streamed(handle) and "FasterCacheBlockHook: FasterCache extrapolates attention outputs" in report
    assert handle.installed[""].plans, report   # the model forward streamed inside the denoiser hook
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref)), report


def test_text_kv_cache_hooks_are_known():
    """The text K/V cache applies to NucleusMoE-Image blocks only (which streamplan does not stream yet): its block
    hook hands cached text K/V through attention_kwargs, so a block with it stays stock, named; its transformer hook
    (which reads the text input's address) has the model forward inside it."""
    from diffusers.hooks.hooks import StateManager
    from diffusers.hooks.text_kv_cache import (TextKVCacheBlockHook, TextKVCacheBlockState, TextKVCacheState,
                                               TextKVCacheTransformerHook)
    model = setups.wan_model()
    state = StateManager(TextKVCacheState)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(TextKVCacheTransformerHook(state), "text_kv")
    HookRegistry.check_if_exists_or_initialize(model.blocks[1]).register_hook(
        TextKVCacheBlockHook(state, StateManager(TextKVCacheBlockState)), "text_kv_block")
    handle = streamplan.apply(model, chunk_tokens=256)
    report = handle.report()
    assert "blocks.1" not in handle.installed and {"", "blocks.0", "blocks.2"} <= set(handle.installed), report
    assert "TextKVCacheBlockHook: the text K/V cache hands the block cached text keys and values" in report


@pytest.mark.parametrize("record_stream", [False, True])
def test_group_offloading_with_streams(monkeypatch, record_stream):
    """Block-level group offloading with use_stream (and record_stream): diffusers refuses streams for a CPU onload
    device, so its own configuration is applied with a CPU stream standing in for the side stream (pinning and
    record_stream made no-ops that count their calls): the lazy prefetch hook on the model traces the block order on
    the first call and then onloads block i+1 while block i runs. The blocks stream inside, the model forward too."""
    from diffusers.hooks.group_offloading import GroupOffloadingConfig, _apply_group_offloading
    recorded = []
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(stream))

    def offload(m):
        _apply_group_offloading(m, GroupOffloadingConfig(
            onload_device=torch.device("cpu"), offload_device=torch.device("cpu"), offload_type="block_level",
            num_blocks_per_group=1, non_blocking=True, stream=torch.cpu.Stream(), record_stream=record_stream,
            low_cpu_mem_usage=False))
    torch.manual_seed(0)
    model = setups.wan_model()
    offload(model)
    assert "lazy_prefetch_group_offloading" in model._diffusers_hook.hooks
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    assert model.blocks[0]._diffusers_hook.hooks["group_offloading"].next_group is not None   # prefetch wired
    handle = streamplan.apply(model, chunk_tokens=256)
    recorded.clear()
    out, peak = streamplan.measure_peak(setups.steps, model)
    report = handle.report()
    assert _streamed(handle) == BLOCKS and handle.installed[""].plans, report
    assert bool(recorded) == record_stream
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref)), report
    assert peak < 0.8 * ref_peak, (peak, ref_peak)
    handle.remove()
    assert all(torch.equal(a, r) for a, r in zip(setups.steps(model), ref))


@torch.no_grad()
def test_float8_weight_only_streams_exact():
    """torchao's float8 weight-only linears (Float8Tensor, a scale per output row) are captured with the block."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_
    torch.manual_seed(0)
    model = setups.wan_model()
    quantize_(model, Float8WeightOnlyConfig())
    caps = streamplan.plan.weight_formats.linear_caps(model.blocks[0].attn1.to_q)
    assert (caps.name, caps.out_slice, caps.in_slice, caps.opaque) == ("torchao float8 weight-only", True, False, False)
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    handle = streamplan.apply(model, chunk_tokens=256)
    out, peak = streamplan.measure_peak(setups.steps, model)
    assert _streamed(handle) == BLOCKS, handle.report()
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref))
    assert peak < 0.85 * ref_peak, (peak, ref_peak)


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
@torch.no_grad()
def test_quantized_mlp_takes_the_slices_its_format_declares(config):
    """A feature-sliced MLP (L2) slices its input projections by output feature and accumulates its output projection
    over input features: torchao's weight-only tensors slice by row (exact) but cannot run the transposed, accumulated
    column slice, so they declare row slices only and the MLP streams in row chunks (L1), exact, where ffn_slice asks
    for L2 (a plain nn.Linear would take it)."""
    import torchao.quantization as tq
    from diffusers.models.attention import FeedForward
    torch.manual_seed(0)
    ff = FeedForward(64, mult=4, activation_fn="gelu-approximate").eval()
    tq.quantize_(ff, getattr(tq, config)())
    w = ff.net[0].proj.weight
    assert torch.equal(torch.nn.functional.linear(torch.ones(2, 64), w[32:64]),
                       torch.nn.functional.linear(torch.ones(2, 64), w)[:, 32:64])   # the row slice is exact
    formats = streamplan.plan.weight_formats
    assert formats.can_slice_out(ff.net[0].proj) and not formats.can_slice_in(ff.net[2])
    x = torch.randn(1, 1024, 64)
    ref = ff(x)
    handle = streamplan.apply(ff, chunk_tokens=256, ffn_slice=64)
    out = ff(x)
    plans = [p for e in handle.installed.values() for p in e.plans.values()]
    assert plans and all(p.tier == "L1" for p in plans), handle.report()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bits", [8, 4])
@torch.no_grad()
def test_bitsandbytes_blocks_stream_in_row_chunks(bits):
    """bitsandbytes 8-bit and 4-bit linears run on the CPU (bitsandbytes 0.50). A block capture cannot trace bnb's
    matmul (it reads the real parameter's quantisation state), so it takes each such layer as one opaque row-local op
    that runs the layer's own forward on the chunk's rows: the blocks stream in row chunks (no feature slices:
    declared), exact against the same quantised model unstreamed, the peak down."""
    torch.manual_seed(0)
    pytest.importorskip("bitsandbytes")
    model = setups.bnb_blocks(setups.wan_model(), bits)
    caps = streamplan.plan.weight_formats.linear_caps(model.blocks[0].ffn.net[2])
    assert caps.name.startswith(f"bitsandbytes {bits}-bit") and not (caps.out_slice or caps.in_slice) and caps.opaque
    ref, ref_peak = streamplan.measure_peak(setups.steps, model)
    handle = streamplan.apply(model, chunk_tokens=256, ffn_slice=64)
    setups.steps(model)   # the capture, outside the measurement
    out, peak = streamplan.measure_peak(setups.steps, model)
    report = handle.report()
    assert _streamed(handle) == BLOCKS, report
    assert all(p.tier == "L1" and p.chunk == 256 for e in handle.installed.values() for p in e.plans.values()
               if isinstance(e.spec, streamplan.specs.GraphSpec)), report
    assert all(rel_err(o, r) <= 1e-5 for o, r in zip(out, ref)), report
    assert peak < 0.75 * ref_peak, (peak, ref_peak)
    assert f"run whole on each chunk's rows as opaque ops (quantised linear: Linear{bits}bit" in report, report
    # the memory model charges each opaque call its weight in the input's dtype (4-bit dequantises it per call)
    from streamplan.graph import _CACHE
    from streamplan.graph.opaque_layers import workspace_bytes
    layers = {name for name, m in model.blocks[0].named_modules()
              if hasattr(m, "weight") and streamplan.plan.weight_formats.linear_caps(m).opaque}
    ops = [n for v in _CACHE.values() if not isinstance(v, str) for n in v.captured.graph.nodes   # this model's
           if n.target is torch.ops.streamplan.opaque_module.default and n.args[1] in layers]    # (not other tests')
    assert len(ops) >= 10 and all(workspace_bytes(n, 256) == n.args[0].meta["val"].shape[-1] * n.args[2] * 4
                                  for n in ops)
    handle.remove()
    assert all(torch.equal(a, r) for a, r in zip(setups.steps(model), ref))


@torch.no_grad()
def test_bitsandbytes_outlier_threshold_keeps_the_layers_stock():
    """LLM.int8 with an outlier threshold picks its fp16 columns from every row of a call: a chunk of rows would pick
    its own (on CUDA; bnb's CPU kernels happen to agree), so nothing containing such a layer streams, named."""
    torch.manual_seed(0)
    pytest.importorskip("bitsandbytes")
    model = setups.bnb_blocks(setups.wan_model(), 8)
    for m in model.blocks.modules():
        if hasattr(m, "state"):
            m.state.threshold = 6.0
    ref = setups.steps(model)
    handle = streamplan.apply(model, chunk_tokens=256)
    out = setups.steps(model)
    report = handle.report()
    assert not _streamed(handle) and "with an outlier threshold weights: its outlier columns" in report, report
    assert not any(p.tier != "L0" for n, e in handle.installed.items() if n.startswith("blocks")
                   for p in e.plans.values()), report
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
