"""Streamed blocks and whole models against the real diffusers / transformers classes' own forward."""
import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from transformers import LlamaConfig, LlamaForCausalLM

import streamplan
from conftest import is_block, rel_err


def _max_rel(out, ref):
    if isinstance(out, tuple):
        return max(_max_rel(o, r) for o, r in zip(out, ref))
    return rel_err(out, ref)


def _graphs(handle):
    """The blocks installed on their captured graph (not the parts a stock block would stream from their own)."""
    return {n: e for n, e in handle.installed.items() if isinstance(e.spec, streamplan.specs.GraphSpec)
            and is_block(n)}


def _quiet(handle, allow=()):
    """No entry noted anything but its capture (and the reasons in ``allow``)."""
    return all(n.startswith(("captured in", *allow)) for e in handle.installed.values() for n in e.runtime_notes)


def _check(module, args, chunk, **kw):
    """Streamed matches stock, the inputs are untouched, and remove() gives stock back bit for bit."""
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref = module(*args)
    handle = streamplan.apply(module, chunk_tokens=chunk, **kw)
    assert isinstance(handle.installed[""].spec, streamplan.specs.GraphSpec), handle.report()   # parts: its fallback
    out = module(*args)
    entry = handle.installed[""]
    assert [n for n in entry.runtime_notes if not n.startswith("captured in")] == [], entry.runtime_notes
    assert all(p.tier in ("L1", "L2") for p in entry.plans.values())
    assert _max_rel(out, ref) <= 1e-5
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), "the caller's input was modified"
    handle.remove()
    again = module(*args)
    assert all(torch.equal(o, r) for o, r in zip(again if isinstance(again, tuple) else (again,),
                                                 ref if isinstance(ref, tuple) else (ref,)))
    return handle


def _wan_block(cross_attn_norm=True, fused=False):
    block = WanTransformerBlock(64, 128, 4, cross_attn_norm=cross_attn_norm).eval()
    if fused:
        block.attn1.fuse_projections()
        block.attn2.fuse_projections()
    return block


def _wan_args(batch, tokens, per_token):
    temb = torch.randn(batch, tokens, 6, 64) if per_token else torch.randn(batch, 6, 64)
    rotary = (torch.randn(1, tokens, 1, 16), torch.randn(1, tokens, 1, 16))
    return (torch.randn(batch, tokens, 64), torch.randn(batch, 13, 64), temb, rotary)


@pytest.mark.parametrize("batch, tokens, chunk", [(1, 100, 33), (2, 77, 16), (2, 50, 64)])
@pytest.mark.parametrize("per_token", [False, True], ids=["temb-per-sample", "temb-per-token"])
@pytest.mark.parametrize("variant", ["plain", "no-cross-norm", "fused", "ffn-sliced"])
@torch.no_grad()
def test_wan_block(batch, tokens, chunk, per_token, variant):
    block = _wan_block(cross_attn_norm=variant != "no-cross-norm", fused=variant == "fused")
    kw = {"ffn_slice": 48} if variant == "ffn-sliced" else {}
    if chunk >= tokens and not kw:
        block(*_wan_args(batch, tokens, per_token))
        return  # nothing to stream: covered by the planner's L0 tests
    _check(block, _wan_args(batch, tokens, per_token), chunk, **kw)


@pytest.mark.parametrize("text_tokens", [9, 12])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
@torch.no_grad()
def test_flux_blocks(text_tokens, fused, single):
    block = (FluxSingleTransformerBlock(64, 4, 16) if single else FluxTransformerBlock(64, 4, 16)).eval()
    if fused:
        block.attn.fuse_projections()
    n = 90
    rotary = (torch.randn(text_tokens + n, 16), torch.randn(text_tokens + n, 16))
    args = (torch.randn(2, n, 64), torch.randn(2, text_tokens, 64), torch.randn(2, 64), rotary)
    _check(block, args, 32)


@torch.no_grad()
def test_flux_block_in_fp16_keeps_the_clip():
    block = FluxSingleTransformerBlock(64, 4, 16).eval()
    args = (torch.randn(1, 40, 64) * 1e4, torch.randn(1, 8, 64), torch.randn(1, 64), None)
    with torch.autocast("cpu", enabled=False):
        block = block.half()
        args = tuple(a.half() if isinstance(a, torch.Tensor) else a for a in args)
        ref = block(*args)
        handle = streamplan.apply(block, chunk_tokens=16)
        out = block(*args)
    assert all(torch.isfinite(o).all() for o in out)
    assert _max_rel(out, ref) <= 2e-3  # fp16 on CPU: row-chunked kernels round differently
    handle.remove()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.no_grad()
def test_llama_decoder_layers_and_causal_lm(impl):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, vocab_size=100, attn_implementation=impl)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 61))
    mask = torch.ones(2, 61, dtype=torch.long)
    mask[1, :7] = 0
    for kw in ({}, {"attention_mask": mask}):
        ref = model(ids, **kw).logits
        handle = streamplan.apply(model, chunk_tokens=16)
        assert len(_graphs(handle)) == 3, handle.report()
        assert isinstance(handle.installed["model.norm"].spec, streamplan.specs.RowLocalSpec)
        out = model(ids, **kw).logits
        keep = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        assert rel_err(out[keep], ref[keep]) <= 1e-5
        # a padding mask reaches the layers described (streamplan.specs.RowMask: SDPA's mask function, or eager's) and
        # they stream from their graphs; eager attention (matmul + softmax) is found in the graph as one attention
        allow = ("its attention mask built",) if kw or impl == "eager" else ()   # eager: a causal mask always
        assert _quiet(handle, allow), handle.report()
        assert [p.tier for p in handle.plans["model.layers.0"]] == ["L1"], handle.report()
        handle.remove()


def _wan_model(**kw):
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=3,
                                 rope_max_seq_len=64, **kw).eval()


@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_whole_wan_model(batch):
    model = _wan_model()
    x = torch.randn(batch, 4, 3, 8, 10)          # 3 * 4 * 5 = 60 tokens
    t = torch.randint(0, 1000, (batch,))
    enc = torch.randn(batch, 7, 32)
    x0 = x.clone()
    ref = model(x, t, enc).sample
    handle = streamplan.apply(model, chunk_tokens=16)
    assert isinstance(handle.installed[""].spec, streamplan.specs.ModelSpec)
    assert len(_graphs(handle)) == 3, handle.report()
    out = model(x, t, enc).sample
    assert rel_err(out, ref) <= 1e-5 and torch.equal(x, x0)
    assert _quiet(handle), handle.report()
    handle.remove()
    assert torch.equal(model(x, t, enc).sample, ref)


@torch.no_grad()
def test_whole_wan_model_with_per_token_timesteps():
    # Wan2.2 TI2V passes one timestep per token; the head and every block then modulate per token
    model = _wan_model()
    x = torch.randn(1, 4, 3, 8, 10)
    t = torch.randint(0, 1000, (1, 60))
    enc = torch.randn(1, 7, 32)
    ref = model(x, t, enc).sample
    handle = streamplan.apply(model, chunk_tokens=16)
    out = model(x, t, enc).sample
    assert rel_err(out, ref) <= 1e-5
    assert _quiet(handle), handle.report()


@torch.no_grad()
def test_wan_per_token_modulation_is_never_whole():
    # Wan2.2 TI2V: the first frame clean (t=0), the rest noisy. Stock builds the 6-row modulation for every token
    # (six residuals wide) and keeps it through every block; streamed, each chunk picks its rows from the two
    # distinct timesteps' tables: the peak grows with the rows as under one timestep
    model = _wan_model()
    enc = torch.randn(1, 7, 32)
    handle = streamplan.apply(model, chunk_tokens=80)
    growth = {}
    for per_token in (True, False):
        peaks = []
        for frames in (5, 10):
            x = torch.randn(1, 4, frames, 16, 20)          # 80 rows a frame
            t = torch.full((1, frames * 80), 900) if per_token else torch.tensor([900])
            if per_token:
                t[:, :80] = 0
            out, peak = streamplan.measure_peak(lambda: model(x, t, enc).sample)
            peaks.append(peak)
        growth[per_token] = peaks[1] - peaks[0]
    assert growth[True] <= 1.05 * growth[False], growth
    handle.remove()
    t = torch.full((1, 800), 900)
    t[:, :80] = 0
    ref, stock_peak = streamplan.measure_peak(lambda: model(x, t, enc).sample)
    handle = streamplan.apply(model, chunk_tokens=80)
    out, peak = streamplan.measure_peak(lambda: model(x, t, enc).sample)
    assert rel_err(out, ref) <= 1e-5 and "built whole" not in handle.report(), handle.report()
    assert peak < 0.5 * stock_peak, (peak, stock_peak)
    handle.remove()


@torch.no_grad()
def test_whole_flux_model_streams_its_blocks():
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=24, axes_dims_rope=(4, 6, 6)).eval()
    n, t = 70, 11
    args = dict(hidden_states=torch.randn(2, n, 16), encoder_hidden_states=torch.randn(2, t, 32),
                pooled_projections=torch.randn(2, 24), timestep=torch.tensor([0.5, 0.2]),
                img_ids=torch.randint(0, 8, (n, 3)).float(), txt_ids=torch.zeros(t, 3))
    ref = model(**args).sample
    handle = streamplan.apply(model, chunk_tokens=16)
    blocks = list(_graphs(handle).values())
    assert len(blocks) == 4, handle.report()
    assert isinstance(handle.installed["norm_out"].spec, streamplan.specs.RowLocalSpec)  # the output head's norm
    out = model(**args).sample
    assert rel_err(out, ref) <= 1e-5
    assert all(e.plans for e in blocks) and _quiet(handle), handle.report()
    assert handle.installed["norm_out"].plans


@torch.no_grad()
def test_an_i2v_block_streams_from_its_graph_and_keeps_its_parts():
    """Wan I2V (image-context cross-attention): the block streams from its captured graph, and its MLP keeps its own
    spec for calls the graph cannot take, its attentions (no recognizer knows ``WanAttention``) a captured graph of
    their own: none is called, or captured, while the block's graph runs (folded into the block's line of the report
    while idle)."""
    block = WanTransformerBlock(64, 128, 4, added_kv_proj_dim=64).eval()
    rotary = (torch.randn(1, 100, 1, 16), torch.randn(1, 100, 1, 16))
    args = (torch.randn(1, 100, 64), torch.randn(1, 4 + 512, 64), torch.randn(1, 6, 64), rotary)
    ref = block(*args)
    handle = streamplan.apply(block, chunk_tokens=16)
    assert set(handle.installed) == {"", "ffn", "attn1", "attn2"}
    assert isinstance(handle.installed[""].spec, streamplan.specs.GraphSpec)
    assert rel_err(block(*args), ref) <= 1e-5
    (plan,) = handle.plans[""]
    assert plan.tier == "L1" and plan.chunk == 16, handle.report()
    for part in ("ffn", "attn1", "attn2"):   # the graph ran the block: its parts were not called
        assert not handle.plans[part] and f"\n  {part}" not in handle.report(), handle.report()
    assert "(else its parts)" in handle.report()
    handle.remove()
    assert torch.equal(block(*args), ref)


@torch.no_grad()
def test_verify_and_self_check(caplog):
    block = _wan_block()
    args = _wan_args(2, 70, False)
    diffs = streamplan.verify(block, *args)
    assert diffs["output"]["rel"] <= 1e-5
    handle = streamplan.apply(block, chunk_tokens=16, self_check=True)
    with caplog.at_level("INFO", logger="streamplan"):
        block(*args)
    assert "self-check against stock" in handle.report()
    logged = [r for r in caplog.records if "self-check against stock" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]   # once, not once per sink
    diffs = streamplan.verify(block, *args)     # already applied: compares with the stock forward in place
    assert 0 <= diffs["output"]["rel"] <= 1e-5
    assert "forward" in block.__dict__


@torch.no_grad()
def test_streamed_wan_block_peaks_near_its_floor():
    """Stock peaks at 176 MiB here (streamplan's meter, which matches the CUDA allocator exactly on the H200); the
    floor, residual + global K + V, is 48 MiB (27% of stock), so no schedule with global K/V reaches 20% of this
    stock. The streamed block holds one copy of the residual (its caller keeps the input) plus chunk transients."""
    torch.manual_seed(0)
    block = WanTransformerBlock(512, 2048, 8).eval()
    x = torch.randn(1, 8192, 512)
    enc = torch.randn(1, 64, 512)
    temb = torch.randn(1, 6, 512)
    freqs = torch.randn(1, 8192, 1, 64)
    args = (x, enc, temb, (freqs.cos(), freqs.sin()))
    ref, stock = streamplan.measure_peak(block, *args)
    handle = streamplan.apply(block, chunk_tokens=1024)
    out, streamed = streamplan.measure_peak(block, *args)
    assert rel_err(out, ref) <= 1e-5
    floor = x.numel() * 4 * 3                   # residual + K + V
    assert stock >= 170 * 2**20
    assert streamed <= 0.45 * stock, (streamed / 2**20, stock / 2**20)
    assert streamed <= floor + x.numel() * 4 + 28 * 2**20  # + the residual copy + 1024 rows of transients
    (plan,) = handle.plans[""]
    assert abs(plan.predicted_peak - streamed) <= 0.25 * streamed, (plan.predicted_peak, streamed)


@torch.no_grad()
def test_a_donated_block_input_is_updated_in_place_without_a_copy():
    from streamplan.execute.donation import donate
    block = WanTransformerBlock(256, 1024, 4).eval()
    x = torch.randn(1, 4096, 256)
    enc, temb = torch.randn(1, 16, 256), torch.randn(1, 6, 256)
    ref = block(x, enc, temb, None)
    streamplan.apply(block, chunk_tokens=512)
    _, copied = streamplan.measure_peak(block, x, enc, temb, None)

    def donated(x):
        with donate(x):
            return block(x, enc, temb, None)

    x2 = x.clone()
    out, in_place = streamplan.measure_peak(donated, x2)
    assert out.data_ptr() == x2.data_ptr() and rel_err(out, ref) <= 1e-5
    assert copied - in_place >= 0.9 * x.numel() * 4


@torch.no_grad()
def test_final_norms_stream_per_chunk_with_their_fp32_promotion():
    from diffusers.models.normalization import AdaLayerNormContinuous
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    rms = LlamaRMSNorm(512).eval()
    rms.weight.data.normal_()
    x = torch.randn(2, 4096, 512, dtype=torch.bfloat16)
    rms = rms.to(torch.bfloat16)
    ref, stock = streamplan.measure_peak(rms, x)
    handle = streamplan.apply(rms, chunk_tokens=512)
    out, streamed = streamplan.measure_peak(rms, x)
    assert torch.equal(out, ref)                    # row chunks of an elementwise-per-row op: bit for bit
    assert streamed <= 0.4 * stock
    handle.remove()
    ada = AdaLayerNormContinuous(64, 32, elementwise_affine=False, eps=1e-6).eval()
    x, emb = torch.randn(2, 300, 64), torch.randn(2, 32)
    ref = ada(x, emb)
    handle = streamplan.apply(ada, chunk_tokens=64)
    assert rel_err(ada(x, emb), ref) <= 1e-6
    assert handle.plans[""][0].tier == "L1"


@torch.no_grad()
def test_generate_streams_the_prefill_and_gives_the_same_tokens():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=100, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (1, 90))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    handle = streamplan.apply(model, chunk_tokens=32)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    layer = handle.installed["model.layers.0"]
    assert any(p.tier == "L1" and p.rows == 90 for p in layer.plans.values()), handle.report()


def test_a_model_forward_streamplan_does_not_follow_stays_stock(monkeypatch):
    from streamplan.integrations.diffusers import models as diffusers_models
    monkeypatch.setitem(diffusers_models.KNOWN_FORWARDS, "WanTransformer3DModel", {"0" * 16: "another version"})
    model = _wan_model()
    handle = streamplan.apply(model, chunk_tokens=16)
    assert "" not in handle.installed and len(_graphs(handle)) == 3     # the blocks still stream
    assert "differs from the versions streamplan follows (another version)" in handle.report()


@torch.no_grad()
def test_composes_with_model_cpu_offload():
    """diffusers' enable_model_cpu_offload puts an accelerate hook on the transformer itself: the hook keeps moving
    weights, the model forward streams inside it, so do its blocks, and remove() gives the hook back."""
    from accelerate import cpu_offload_with_hook
    model = _wan_model()
    x, t, enc = torch.randn(1, 4, 3, 8, 10), torch.tensor([10]), torch.randn(1, 7, 32)
    ref = model(x, t, enc).sample
    model, _ = cpu_offload_with_hook(model, execution_device="cpu")
    hooked = model.__dict__["forward"]
    handle = streamplan.apply(model, chunk_tokens=16)
    out = model(x, t, enc).sample
    assert rel_err(out, ref) <= 1e-5
    assert set(_graphs(handle)) == {"blocks.0", "blocks.1", "blocks.2"}
    assert handle.installed[""].plans and "runs inside hooks: accelerate CpuOffload" in handle.report()
    handle.remove()
    assert model.__dict__["forward"] is hooked


@torch.no_grad()
def test_a_hook_added_inside_a_block_after_apply_runs_stock_and_sees_real_tensors():
    """A capture would fire the hook on fake tensors and the graph would skip it afterwards: the call runs stock."""
    block = _wan_block()
    args = _wan_args(1, 70, False)
    ref = block(*args)
    handle = streamplan.apply(block, chunk_tokens=16)
    seen = []
    hook = block.attn1.to_k.register_forward_hook(lambda m, i, o: seen.append(type(o)))
    out = block(*args)
    hook.remove()
    assert seen == [torch.Tensor] and rel_err(out, ref) <= 1e-5
    assert "attn1.to_k has forward hooks at call time" in handle.report(), handle.report()
    assert not handle.plans[""]
    assert rel_err(block(*args), ref) <= 1e-5 and handle.plans[""]     # the hook gone: it streams
