"""streamplan.integrations.comfy against a real ComfyUI (0.33.0, see tests/comfy_support.py): tiny random-weight Wan,
Flux,
HunyuanVideo, LTX-Video and MiniMax-H3 diffusion models inside real ``BaseModel``s and ``ModelPatcher``s, run the way
ComfyUI's sampling runs them (``BaseModel.apply_model`` with the patcher's ``transformer_options``), stock against
``streamplan.integrations.comfy.patch``."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import streamplan
from comfy_support import comfy_api_io, comfyui
from conftest import rel_err

CPU = torch.device("cpu")


def _analyze_module():
    import streamplan.graph.analyze  # noqa: F401 -- the package attribute ``analyze`` is the function
    return sys.modules["streamplan.graph.analyze"]


@pytest.fixture
def fresh_captures(monkeypatch):
    """Captures (and their analyses) are cached per block class for the process: each test here starts empty."""
    import streamplan.graph  # noqa: F401 -- sys.modules holds it after this
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})


def _random_(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():   # comfy.ops layers skip init: every weight is uninitialised memory
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05))


def _config(comfy, unet: dict, latent_format):
    class Config(comfy.supported_models_base.BASE):
        unet_config = {}
        unet_extra_config = {}
        sampling_settings = {"shift": 1.0}
        supported_inference_dtypes = [torch.float32]
    Config.latent_format = latent_format
    return Config(unet)


def wan_patcher(layers: int = 2):
    comfy = comfyui()
    unet = {"image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "num_heads": 4,
            "num_layers": layers, "in_dim": 4, "out_dim": 4, "text_dim": 32, "freq_dim": 32, "eps": 1e-6,
            "patch_size": (1, 2, 2)}
    base = comfy.model_base.WAN21(_config(comfy, unet, comfy.latent_formats.Wan21))
    _random_(base)
    x = torch.randn(1, 4, 3, 32, 32)            # 3 x 16 x 16 = 768 tokens
    cond = {"c_crossattn": torch.randn(1, 7, 32)}
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


def flux_patcher():
    comfy = comfyui()
    unet = {"image_model": "flux", "in_channels": 4, "out_channels": 4, "vec_in_dim": 16, "context_in_dim": 32,
            "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
            "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": False,
            "txt_ids_dims": []}
    base = comfy.model_base.Flux(_config(comfy, unet, comfy.latent_formats.Flux))
    _random_(base)
    x = torch.randn(1, 4, 48, 48)               # 24 x 24 = 576 image tokens
    cond = {"c_crossattn": torch.randn(1, 9, 32), "y": torch.randn(1, 16)}
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


def _conds(base, **kwargs):
    """The model's conditioning the way ComfyUI builds it (``BaseModel.extra_conds``), unwrapped for one call."""
    return {k: v.cond for k, v in base.extra_conds(device=CPU, **kwargs).items()}


def h3_patcher():
    """MiniMax-H3 (audio + video packed into one sequence): the sampler's packed latent and ``latent_shapes``."""
    comfy = comfyui()   # comfy.model_base imported comfy.utils
    unet = {"image_model": "minimax_h3", "hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1,
            "num_attention_heads": 2, "attention_head_dim": 32, "ffn_hidden_size": 128, "latents_dim": 4,
            "audio_latents_dim": 4, "text_dim": 32, "timestep_input_dim": 32, "time_embed_hidden_size": 64,
            "time_embed_dim": 32, "rope_inv_freq_len": 4}
    base = comfy.model_base.MiniMaxH3(_config(comfy, unet, comfy.latent_formats.MiniMaxH3AV))
    _random_(base)
    with torch.no_grad():   # a buffer, left uninitialised like the weights
        base.diffusion_model.rope.inv_freq.copy_(1.0 / 100.0 ** (torch.arange(4) / 4))
    video, audio = torch.randn(1, 4, 3, 16, 16), torch.randn(1, 4, 2, 40)   # 192 video + 80 audio rows, 7 text
    x, shapes = comfy.utils.pack_latents([video, audio])
    cond = _conds(base, cross_attn=torch.randn(1, 7, 32), latent_shapes=shapes)
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


def ltxv_patcher(text_mask: bool = False):
    comfy = comfyui()
    unet = {"image_model": "ltxv", "in_channels": 8, "cross_attention_dim": 64, "attention_head_dim": 16,
            "num_attention_heads": 4, "caption_channels": 32, "num_layers": 2}
    base = comfy.model_base.LTXV(_config(comfy, unet, comfy.latent_formats.LTXV))
    _random_(base)
    x = torch.randn(1, 8, 3, 16, 16)            # 3 x 16 x 16 = 768 tokens
    mask = torch.ones(1, 7)
    mask[:, 5:] = 0                             # padded text, as ComfyUI's T5 encoder gives it
    cond = _conds(base, cross_attn=torch.randn(1, 7, 32), attention_mask=mask if text_mask else None)
    cond.setdefault("attention_mask", None)     # LTXV's forward takes it positionally
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


def hunyuan_video_patcher(text_mask: bool = False):
    comfy = comfyui()
    unet = {"image_model": "hunyuan_video", "in_channels": 4, "out_channels": 4, "vec_in_dim": 16,
            "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 2,
            "depth_single_blocks": 2, "axes_dim": [4, 6, 6], "theta": 256, "patch_size": [1, 2, 2],
            "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
            "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
    base = comfy.model_base.HunyuanVideo(_config(comfy, unet, comfy.latent_formats.HunyuanVideo))
    _random_(base)
    x = torch.randn(1, 4, 3, 16, 16)            # 3 x 8 x 8 = 192 image tokens, 9 text
    mask = torch.ones(1, 9, dtype=torch.long)
    mask[:, 6:] = 0
    cond = _conds(base, cross_attn=torch.randn(1, 9, 32), pooled_output=torch.randn(1, 16),
                  attention_mask=mask if text_mask else None)
    return comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU), x, cond


def sample_call(patcher, x, cond):
    """One model call the way ComfyUI's samplers make it: ``apply_model`` with a copy of the patcher's
    ``transformer_options`` (comfy.samplers.calc_cond_batch)."""
    options = patcher.model_options["transformer_options"].copy()
    options["cond_or_uncond"] = [0]
    options["sigmas"] = torch.tensor([0.7])
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([0.7]), transformer_options=options, **cond)


def _forwards_installed(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def _stream_and_compare(base, x, cond):
    """Stock, then ``patch(...)`` with 64-row chunks: the output within fp32 rel 1e-5, the peak down, the base patcher
    and the shared model as they were. Returns (patched, its report, the patched model's block keys)."""
    import streamplan.integrations.comfy as sc
    before = copy.copy(base.model_options["transformer_options"])
    stock, stock_peak = streamplan.measure_peak(sample_call, base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert peak < stock_peak, (peak, stock_peak)
    assert base.model_options["transformer_options"] == before
    assert _forwards_installed(base.model) == []
    return patched, sc.report(patched), [k for k, _, _ in sc.block_keys(base.model.diffusion_model)]


def test_patch_streams_every_wan_block(fresh_captures):
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher()
    before = copy.copy(base.model_options["transformer_options"])
    stock, stock_peak = streamplan.measure_peak(sample_call, base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    text = sc.report(patched)
    keys = sc.block_keys(base.model.diffusion_model)
    assert len(keys) == 2
    for key, _, _ in keys:
        section = text.split(f"  {key[0]}.{key[1]}: ", 1)[1].split("\n  double_block.")[0].split("\n  single_block.")[0]
        assert "1 call(s) through the streamer" in section, text
        assert " L1 " in section, text
    assert peak < stock_peak, (peak, stock_peak)
    # the base patcher and the shared model are as they were
    assert base.model_options["transformer_options"] == before
    assert "patches_replace" not in base.model_options["transformer_options"]
    assert patched.model is base.model
    assert _forwards_installed(base.model) == []
    again = sample_call(base, x, cond)
    assert torch.equal(again, stock)


def test_patch_streams_every_flux_block(fresh_captures):
    """Flux's double and single blocks (comfy_kitchen's rope, the image stream updated in place as ComfyUI does,
    text rows joined to the image rows) stream through the host's own block_wrap and come back exact."""
    patched, text, keys = _stream_and_compare(*flux_patcher())
    assert keys == [("double_block", 0), ("double_block", 1), ("single_block", 0), ("single_block", 1)]
    for name, index in keys:
        assert f"{name}.{index}: 1 call(s) through the streamer" in text, text
    assert text.count(": L1 rows=") == 4 and "ran stock" not in text, text


def _block_lines(text: str) -> dict[str, str]:
    """``"double_block.0"`` -> that block's section of a report (its line and its streamer's report)."""
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line[2:].split(":")[0].count(".") == 1:
            name = line[2:].split(":")[0]
            out[name] = line
        elif name is not None:
            out[name] += "\n" + line
    return out


def test_patch_streams_every_hunyuan_video_block(fresh_captures):
    """HunyuanVideo (Flux's double and single stream blocks under its own forward, "attention_mask" in the args
    dict): every block streams without a text mask, and with one (a mask over the joint rows' keys, whole for every
    Q chunk) under the streamed model forward, which gives it as the [1, 1, 1, keys] view ComfyUI's attention makes
    of it. Under the stock forward (the wrapper taken out) the [1, 1, keys] mask is reshaped inside the block: each
    block makes it whole for every Q chunk from that input (``graph.pair_masks``) and streams."""
    import streamplan.integrations.comfy as sc
    patched, text, keys = _stream_and_compare(*hunyuan_video_patcher())
    assert keys == [("double_block", 0), ("double_block", 1), ("single_block", 0), ("single_block", 1)]
    sections = _block_lines(text)
    for name, index in keys:
        section = sections[f"{name}.{index}"]
        assert section.startswith(f"  {name}.{index}: 1 call(s) through the streamer"), text
        assert ": L1 rows=" in section, text

    masked, x, cond = hunyuan_video_patcher(text_mask=True)
    stock = sample_call(masked, x, cond)
    patched = sc.patch(masked, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert text.count("attn_mask=(1, 1, 1, 201)") == 4 and "ran stock" not in text, text
    blocks_only = _without_wrapper(sc.patch(masked, budget=None, chunk_tokens=64, min_tokens=0))
    assert rel_err(sample_call(blocks_only, x, cond), stock) <= 1e-5
    text = sc.report(blocks_only)
    assert text.count("1 key mask(s) made inside the block from its inputs") == 4, text
    assert text.count(": L1 rows=") == 4 and "ran stock" not in text, text


def test_patch_streams_every_ltxv_block(fresh_captures):
    """LTX-Video's BasicTransformerBlock (comfy_kitchen's fused ``rms_adaln``, cross-attention to text) streams, with
    and without ComfyUI's T5 text mask (a mask over the text keys of its cross-attention, not over the rows)."""
    for text_mask in (False, True):
        patched, text, keys = _stream_and_compare(*ltxv_patcher(text_mask=text_mask))
        assert keys == [("double_block", 0), ("double_block", 1)]
        sections = _block_lines(text)
        for name, index in keys:
            assert ": L1 rows=" in sections[f"{name}.{index}"], text


_H3_SHIFTS = {"minimax_h3_sigma_shift_video": 5.0, "minimax_h3_sigma_shift_audio": 2.0}


def _h3_run(patcher, **options):
    """A clone of ``patcher`` the way ComfyUI's H3 sampling node leaves it (its timestep shifts in
    transformer_options, read by the model forward before the blocks), plus ``options``."""
    run = patcher.clone()
    run.model_options["transformer_options"].update(_H3_SHIFTS, **options)
    return run


def test_h3_blocks_stream(fresh_captures):
    """MiniMax-H3's DiTBlock (2-D packed rows, modulation per segment of rows at Python bounds, comfy_kitchen's fused
    in-place q/k RMSNorm + split-half rope, the residual updated in place) streams from its captured graph: 64-row
    chunks that cut across the text/audio/video segments, bit-identical to ComfyUI's own forward, peak down."""
    import streamplan.integrations.comfy as sc
    base, x, cond = h3_patcher()
    before = copy.copy(base.model_options["transformer_options"])
    stock, stock_peak = streamplan.measure_peak(sample_call, _h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    out, peak = streamplan.measure_peak(sample_call, run, x, cond)
    assert torch.equal(out, stock)
    assert peak < stock_peak, (peak, stock_peak)
    text = sc.report(run)
    assert [k for k, _, _ in sc.block_keys(base.model.diffusion_model)] == [("double_block", 0), ("double_block", 1)]
    sections = _block_lines(text)
    for name in ("double_block.0", "double_block.1"):
        assert sections[name].startswith(f"  {name}: 1 call(s) through the streamer"), text
        assert ": L1 rows=279 chunk=64" in sections[name] and "ran stock" not in sections[name], text
    assert base.model_options["transformer_options"] == before
    assert _forwards_installed(base.model) == []
    assert torch.equal(sample_call(_h3_run(base), x, cond), stock)


def test_h3_segments_as_rows():
    """The per-segment bounds become one table row per packed row, or the reason they cannot."""
    from streamplan.integrations.comfy.h3 import segment_rows
    rows = segment_rows([(0, 2, 1), (2, 5, 3)], 5, CPU)
    assert rows.tolist() == [[1, 1, 3, 3, 3]]
    assert "cover 4 rows of 5" in segment_rows([(0, 4, 0)], 5, CPU)
    assert "not contiguous" in segment_rows([(0, 2, 0), (3, 5, 1)], 5, CPU)
    assert "not contiguous" in segment_rows([(0, 2.0, 0)], 2, CPU)
    assert "not a list" in segment_rows(None, 2, CPU)


def test_h3_unknown_forward_stays_stock(fresh_captures, monkeypatch):
    """A segment helper that is not ComfyUI 0.33.0's (a node pack replacing it, another ComfyUI version) keeps every
    block stock, exactly, with the reason."""
    comfyui()
    import comfy.ldm.minimax.model as h3

    import streamplan.integrations.comfy as sc
    base, x, cond = h3_patcher()
    stock_gate = h3._mod_gate

    def _mod_gate(x, gate, other, segments):
        return stock_gate(x, gate, other, segments)

    monkeypatch.setattr(h3, "_mod_gate", _mod_gate)
    stock = sample_call(_h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    assert torch.equal(sample_call(run, x, cond), stock)
    text = sc.report(run)
    assert text.count("1 call(s) stock: _mod_gate is not the code streamplan follows (ComfyUI 0.33.0's): unknown "
                      "forward") == 2, text
    assert "through the streamer" not in text


def _attention_spy(calls: list):
    """ComfyUI's PyTorch attention, recording how many query rows each call attends."""
    import comfy.ldm.modules.attention as attention

    def streamplan_spy(q, k, v, heads, **kwargs):
        calls.append(q.shape[-2])
        return attention.attention_pytorch(q, k, v, heads, **kwargs)

    return streamplan_spy


def test_chunks_attend_through_comfy_optimized_attention(fresh_captures, monkeypatch):
    """With no override, every streamed Q chunk of a Wan and of an H3 block goes to
    ``comfy.ldm.modules.attention.optimized_attention`` (what ComfyUI selected at start-up: Sage, flash, PyTorch)."""
    comfyui()
    import comfy.ldm.modules.attention as attention

    import streamplan.integrations.comfy as sc
    calls: list = []
    monkeypatch.setattr(attention, "optimized_attention", _attention_spy(calls))   # the blocks' own imports: stock
    base, x, cond = wan_patcher()
    stock = sample_call(base, x, cond)
    assert calls == []
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    assert calls == [64] * 12 * 2, calls                  # 768 rows in 64-row chunks, two blocks
    assert sc.report(patched).count("attention chunks to ComfyUI optimized_attention") == 2

    calls.clear()
    base, x, cond = h3_patcher()
    stock = sample_call(_h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    assert torch.equal(sample_call(run, x, cond), stock)
    assert calls == [64, 64, 64, 64, 23] * 2, calls       # 279 packed rows


def test_h3_registered_attention_function_serves_chunks(fresh_captures, monkeypatch):
    """An attention function registered with ComfyUI and set on the model with ``set_model_optimized_attention``
    (ComfyUI's own override) attends every streamed Q chunk of H3's and Wan's blocks (Wan's text cross-attention runs
    inside the captured graph as PyTorch SDPA, as with any selected attention); the streamers' stock runs keep it."""
    comfyui()
    import comfy.ldm.modules.attention as attention

    import streamplan.integrations.comfy as sc
    calls: list = []
    spy = _attention_spy(calls)
    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "streamplan_spy", spy)
    base, x, cond = h3_patcher()
    stock_run = _h3_run(base)
    stock_run.set_model_optimized_attention(spy)
    stock = sample_call(stock_run, x, cond)
    assert calls == [279, 279], calls                     # the two DiT blocks (the text was refined in extra_conds)
    calls.clear()
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    run.set_model_optimized_attention(spy)
    out = sample_call(run, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert calls == [64, 64, 64, 64, 23] * 2, calls
    text = sc.report(run)
    assert text.count("attention chunks to ComfyUI optimized_attention (override: streamplan_spy)") == 2, text

    base, x, cond = wan_patcher(layers=1)
    stock_run = base.clone()
    stock_run.set_model_optimized_attention(spy)
    calls.clear()
    stock = sample_call(stock_run, x, cond)
    assert calls == [768, 768], calls                     # self- and cross-attention, whole Q
    calls.clear()
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    run.set_model_optimized_attention(spy)
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert calls == [64] * 12, calls
    assert "attention chunks to ComfyUI optimized_attention (override: streamplan_spy)" in sc.report(run)
    calls.clear()
    short = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=10 ** 6)   # every call stock, in the streamer
    short.set_model_optimized_attention(spy)
    assert torch.equal(sample_call(short, x, cond), stock) and calls == [768, 768], calls


class _StreamedConsumer:
    """An external attention consumer that opted in to the streamed contract (as the H3-Optimizations pack's do):
    ``consume`` gets each Q chunk with the whole K and V; called as an override, it is ComfyUI's function."""

    supports_streamed_h3_qkv = True

    def __init__(self):
        self.chunks: list = []

    def __call__(self, func, *args, **kwargs):
        return func(*args, **kwargs)

    def consume(self, *, q_chunk, global_k, global_v, q_start, q_total, layer_index, transformer_options):
        self.chunks.append((layer_index, q_start, q_chunk.shape[-2], q_total))
        assert "optimized_attention_override" in transformer_options
        return torch.nn.functional.scaled_dot_product_attention(q_chunk, global_k, global_v)


def test_h3_streamed_contract_consumer(fresh_captures):
    import streamplan.integrations.comfy as sc
    consumer = _StreamedConsumer()
    base, x, cond = h3_patcher()
    stock = sample_call(_h3_run(base, optimized_attention_override=consumer), x, cond)
    assert consumer.chunks == []
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0), optimized_attention_override=consumer)
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert consumer.chunks == [(i, a, min(64, 279 - a), 279) for i in (0, 1) for a in range(0, 279, 64)]
    assert sc.report(run).count("attention chunks to _StreamedConsumer.consume (streamed contract)") == 2


def test_min_tokens_keeps_short_calls_stock():
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher()
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64)      # min_tokens 4096 > 768
    assert torch.equal(sample_call(patched, x, cond), stock)
    text = sc.report(patched)
    assert text.count("1 call(s) under min_tokens ran stock") == 2, text
    assert "through the streamer" not in text


def test_foreign_block_replacement_is_left_in_place(fresh_captures):
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher()
    calls = []

    def foreign(args, extra):
        calls.append(args["img"].shape)
        return extra["original_block"](args)

    other = base.clone()
    other.set_model_patch_replace(foreign, "dit", "double_block", 1)
    stock = sample_call(base, x, cond)
    patched = sc.patch(other, budget=None, chunk_tokens=64, min_tokens=0)
    assert patched.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 1)] is foreign
    out = sample_call(patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert len(calls) == 1
    text = sc.report(patched)
    assert f"double_block.1: {sc.LEFT_TO_EXISTING} (" in text and "foreign" in text, text
    assert "double_block.0: 1 call(s) through the streamer" in text, text


def test_fail_closed_cases(fresh_captures):
    """An attention override, a block-level patch and an unknown transformer_options key keep the block stock,
    exactly, with the reason in the report."""
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher(layers=1)
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)

    def override(func, *args, **kwargs):
        return func(*args, **kwargs)

    def attn2(p):
        return p["x"]

    cases = [({"optimized_attention_override": override}, "optimized_attention_override"),
             ({"patches": {"attn2_patch": [attn2]}}, "block-level patches in transformer_options: attn2_patch"),
             ({"some_custom_switch": True}, "does not know: some_custom_switch")]
    for extra, reason in cases:
        run = patched.clone()
        run.model_options["transformer_options"].update(extra)
        assert torch.equal(sample_call(run, x, cond), stock), reason
        assert reason in sc.report(run), sc.report(run)


def test_patch_refuses_bad_arguments():
    import streamplan.integrations.comfy as sc
    base, _, _ = wan_patcher(layers=1)
    with pytest.raises(ValueError, match="min_tokens"):
        sc.patch(base, min_tokens=-1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        sc.patch(base, chunk_tokens=0)
    with pytest.raises(ValueError, match="ModelPatcher"):
        sc.patch(base.model)
    assert "patches_replace" not in base.model_options["transformer_options"]


def test_stream_blocks_node_function(fresh_captures):
    from streamplan.integrations.comfy.nodes import stream_blocks
    base, x, cond = wan_patcher()
    stock = sample_call(base, x, cond)
    patched, text = stream_blocks(base, "none", 64, 0, "", False)
    assert patched is not base and "double_block.0: not called yet" in text
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    from streamplan.integrations.comfy import report
    assert "double_block.1: 1 call(s) through the streamer" in report(patched)
    patched, text = stream_blocks(base, "auto", 0, 4096, "1GiB", True)
    assert "budget 'auto'" in text and "reserve '1GiB'" in text and "self_check True" in text
    with pytest.raises(ValueError):
        stream_blocks(base, "lots", 0, 0, "", False)


def test_stream_report_node_function(fresh_captures):
    """"Stream Report" after a run: the samples pass through, the report says what each block did."""
    from streamplan.integrations.comfy.nodes import stream_blocks, stream_report
    base, x, cond = h3_patcher()
    patched, _ = stream_blocks(base, "none", 64, 0, "", False)
    latent = {"samples": x}
    samples, text = stream_report(patched, latent)
    assert samples is latent and text.count(": not called yet") == 3, text
    sample_call(_h3_run(patched), x, cond)
    samples, text = stream_report(patched, latent)
    assert text.count("1 call(s) through the streamer; attention chunks to ComfyUI optimized_attention") == 2, text
    assert stream_report(base, latent)[1].startswith(
        "streamplan.integrations.comfy: this model has no streamplan block")


def test_node_schema_and_execute(fresh_captures):
    io = comfy_api_io()
    import asyncio

    from streamplan.integrations.comfy import nodes
    node, report_node = nodes.node_classes()
    schema = node.GET_SCHEMA()
    assert schema.node_id == nodes.NODE_ID
    assert [i.id for i in schema.inputs] == ["model", "budget", "chunk_tokens", "min_tokens", "reserve", "self_check",
                                             "kv"]
    assert [i.optional for i in schema.inputs][-1], "kv is optional: workflows saved without it still validate"
    assert [o.io_type for o in schema.outputs] == ["MODEL", "STRING"]
    base, x, cond = wan_patcher()
    out = node.execute(model=base, budget="none", chunk_tokens=64, min_tokens=0, reserve="", self_check=False,
                       kv="host")
    patched, text = out.result
    assert "2 block(s) patched" in text
    assert rel_err(sample_call(patched, x, cond), sample_call(base, x, cond)) <= 1e-5
    after = nodes.report(patched)
    assert "kv host" in after and "tiers: L4 K/V staged in host memory" in after, after
    schema = report_node.GET_SCHEMA()
    assert schema.node_id == nodes.REPORT_NODE_ID and [i.id for i in schema.inputs] == ["model", "samples"]
    latent = {"samples": x}
    out = report_node.execute(model=patched, samples=latent)
    assert out.result[0] is latent and "double_block.0: 1 call(s) through the streamer" in out.result[1]
    ext = asyncio.run(nodes.comfy_entrypoint())
    assert [n.GET_SCHEMA().node_id for n in asyncio.run(ext.get_node_list())] == [nodes.NODE_ID,
                                                                                   nodes.REPORT_NODE_ID]
    assert isinstance(io.ComfyNode, type)


def test_custom_nodes_entry_imports_without_comfyui():
    """ComfyUI loads custom_nodes/<dir>/__init__.py under a name made of its path; the entry must import and offer
    ``comfy_entrypoint`` without ComfyUI's API (it is imported when ComfyUI awaits the entrypoint)."""
    import importlib.util
    import inspect
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(str(root).replace(".", "_x_"), root / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert inspect.iscoroutinefunction(module.comfy_entrypoint)


# --- the DIFFUSION_MODEL wrapper: the model forward streamed (input projection, donated blocks, output head) -------

def _wan_long():
    """Wan with 4 x 32 x 32 = 4096 rows (chunk transients small beside the rows)."""
    base, _, cond = wan_patcher()
    return base, torch.randn(1, 4, 4, 64, 64), cond, 4096


def _h3_long():
    """H3 with 4 x 32 x 32 video rows, 200 audio rows and 7 text rows packed: 4303 rows."""
    comfy = comfyui()
    base, _, _ = h3_patcher()
    video, audio = torch.randn(1, 4, 4, 64, 64), torch.randn(1, 4, 2, 100)
    x, shapes = comfy.utils.pack_latents([video, audio])
    return base, x, _conds(base.model, cross_attn=torch.randn(1, 7, 32), latent_shapes=shapes), 4303


def _without_wrapper(patched):
    """The same patch with its DIFFUSION_MODEL wrapper taken out: the blocks alone stream."""
    run = patched.clone()
    run.model_options["transformer_options"]["wrappers"]["diffusion_model"].pop("streamplan")
    return run


@pytest.mark.parametrize("family", ["wan", "h3"])
def test_model_forward_streams_to_the_blocks_floor(fresh_captures, family):
    """The whole apply_model call, as ComfyUI samples it, through patch(): the model forward streamed (the input
    projection into one buffer, each block's input donated, the head on row chunks), within fp32 rel 1e-5 of stock.
    Its measured peak is near the blocks' floor (residual + K + V + the rope table the blocks read, fp32):
    Wan 1.19x, H3 1.23x measured at 256-row chunks (stock 2.53x and 3.06x; the blocks streamed under the stock
    forward, the wrapper taken out, 1.47x and 1.55x)."""
    import streamplan.integrations.comfy as sc
    base, x, cond, rows = _wan_long() if family == "wan" else _h3_long()
    run = (lambda p: p) if family == "wan" else _h3_run
    before = copy.copy(base.model_options["transformer_options"])
    stock, stock_peak = streamplan.measure_peak(sample_call, run(base), x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=256, min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, run(patched), x, cond)
    assert rel_err(out, stock) <= 1e-5
    blocks_only, blocks_peak = streamplan.measure_peak(sample_call, run(_without_wrapper(patched)), x, cond)
    assert rel_err(blocks_only, stock) <= 1e-5
    dm = base.model.diffusion_model
    if family == "wan":
        rope = rows * dm.dim // dm.num_heads * 2 * 4          # [1, rows, 1, head_dim / 2, 2, 2] fp32
        floor = rows * 3 * dm.dim * 4
    else:
        rope = rows * dm.rope.inv_freq.numel() * 3 * 4 * 4    # [1, rows, 1, 3 x 4 pairs, 2, 2] fp32
        floor = rows * (dm.hidden_size + 2 * 2 * 32) * 4
    ratio = peak / (floor + rope)
    print(f"{family}: whole apply_model peak / blocks' floor {ratio:.2f} (stock {stock_peak / (floor + rope):.2f}, "
          f"blocks alone streamed {blocks_peak / (floor + rope):.2f})")
    assert ratio <= 1.3, (ratio, peak, floor, rope)
    assert peak < 0.85 * blocks_peak and peak < 0.5 * stock_peak, (peak, blocks_peak, stock_peak)
    text = sc.report(run(patched))
    assert "model forward (" in text and ": 1 call(s) streamed (input projection and output head in 256-row " \
        "chunks, 2 block input(s) donated in the last)" in text, text
    assert base.model_options["transformer_options"] == before
    assert "wrappers" not in base.model_options["transformer_options"]
    assert _forwards_installed(base.model) == []


def test_model_forward_fail_closed(fresh_captures, monkeypatch):
    """What the streamed forward does not cover runs the stock forward (its blocks still stream), exactly, with the
    reason in the report: another DIFFUSION_MODEL wrapper inside streamplan's, code that is not ComfyUI 0.33.0's,
    a subclass with its own forward, arguments the stock forward joins to the rows, conditioning rows."""
    comfyui()
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.wan.model as wan
    import comfy.patcher_extension as ext

    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher(layers=1)
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)

    seen = []

    def other_wrapper(executor, *args, **kwargs):
        seen.append(1)
        return executor(*args, **kwargs)

    inner = patched.clone()
    ext.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "other", other_wrapper, inner.model_options,
                             is_model_options=True)
    assert rel_err(sample_call(inner, x, cond), stock) <= 1e-5 and seen == [1]
    assert "1 call(s) stock: another DIFFUSION_MODEL wrapper runs inside streamplan's " \
        "(test_model_forward_fail_closed.<locals>.other_wrapper)" in sc.report(inner)

    concat = torch.randn(1, 4, 1, 32, 32)
    stock_concat = sample_call(base, x, {**cond, "time_dim_concat": concat})
    run = patched.clone()
    assert rel_err(sample_call(run, x, {**cond, "time_dim_concat": concat}), stock_concat) <= 1e-5
    assert "time_dim_concat is given" in sc.report(run)

    class OwnForwardWan(wan.WanModel):
        def _forward(self, *args, **kwargs):
            return super()._forward(*args, **kwargs)

    sub, x1, cond1 = wan_patcher(layers=1)
    sub.model.diffusion_model.__class__ = OwnForwardWan
    stock_sub = sample_call(sub, x1, cond1)
    run = sc.patch(sub, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(run, x1, cond1), stock_sub) <= 1e-5
    assert "OwnForwardWan is a subclass of WanModel with its own forward" in sc.report(run)

    base, x, cond = h3_patcher()
    stock_head = h3.FinalLayer.forward

    def forward(self, *args):
        return stock_head(self, *args)

    monkeypatch.setattr(h3.FinalLayer, "forward", forward)
    stock = sample_call(_h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    assert torch.equal(sample_call(run, x, cond), stock)
    text = sc.report(run)
    assert "1 call(s) stock: FinalLayer.forward is not the code streamplan follows (ComfyUI 0.33.0's)" in text, text
    assert text.count("1 call(s) through the streamer") == 2, text   # the blocks still stream

    from streamplan.integrations.comfy.forwards import _H3
    assert "minimax_payload has refs" in _H3.problem(base.model.diffusion_model, {
        "x": [torch.zeros(1, 4, 1, 2, 2), torch.zeros(1, 4, 2, 3)], "minimax_payload": {"refs": [{"kind": "image"}]}})


def test_weight_patches_per_call_stream(fresh_captures):
    """A patch ComfyUI applies at call time (a ``weight_function`` on a comfy.ops layer, as LoRA under lowvram) is
    taken with the layer's weight once per block call (streamplan/integrations/comfy/weights.py), never traced into
    the graph every
    block of the class shares: both blocks stream, exactly (tests/test_comfy_weights.py: lowvram loads and LoRA)."""
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher()
    plain = sample_call(base, x, cond)
    block = base.model.diffusion_model.blocks[1]
    block.self_attn.o.weight_function = [lambda w: w * 3]
    stock = sample_call(base, x, cond)
    assert rel_err(stock, plain) > 1e-2
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    sections = _block_lines(sc.report(patched))
    assert sections["double_block.0"].startswith("  double_block.0: 1 call(s) through the streamer")
    assert sections["double_block.1"].startswith("  double_block.1: 1 call(s) through the streamer")
    assert "1 comfy.ops layer(s) cast per call (weight patches)" in sections["double_block.1"]


def test_cast_weights_taken_once_per_block_call(fresh_captures):
    """comfy.ops layers that cast their weights at every call (manual casting: bf16 storage, fp32 compute): the cast
    is taken through comfy.ops' own cast path once per block call (streamplan/integrations/comfy/weights.py), as many
    casts at 12
    chunks as at one, and the output matches stock."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher(layers=1)
    block = base.model.diffusion_model.blocks[0]
    for m in block.modules():
        if hasattr(m, "comfy_cast_weights") and getattr(m, "weight", None) is not None:
            m.comfy_cast_weights = True
            m.to(torch.bfloat16)
    stock = sample_call(base, x, cond)

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16:
                self.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for chunk in (64, 768):
        patched = sc.patch(base, budget=None, chunk_tokens=chunk, min_tokens=0)
        sample_call(patched, x, cond)                      # capture and plan
        with Casts() as casts:
            out = sample_call(patched, x, cond)
        assert rel_err(out, stock) <= 1e-5
        counts.append(casts.n)
        assert "through the streamer" in sc.report(patched)
    assert counts[0] == counts[1] > 0, counts


def test_budgets_as_comfyui_sees_memory(fresh_captures, monkeypatch):
    """"auto": ComfyUI's free memory less --reserve-vram (extra_reserved_memory) and the node's reserve; an explicit
    budget: the room above what the block call holds when it is entered, or for a model forward streamplan runs and
    plans whole (Wan here: tests/test_comfy_forward_budget.py), above the forward's start. A small room plans small
    chunks; the output stays exact."""
    comfyui()
    import comfy.model_management as mm

    from streamplan.integrations.comfy.memory import room_for, streamer_budget
    from streamplan.integrations.comfy.patch import Options as PatchOptions
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: 10 * 2**30)
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: 2**30)
    assert room_for(PatchOptions(budget="auto", reserve="1GiB"), CPU) == 8 * 2**30
    assert room_for(PatchOptions(budget="auto"), CPU) == 9 * 2**30 - 512 * 2**20
    assert room_for(PatchOptions(budget=None), CPU) is None
    x = torch.zeros(10, 4)
    assert streamer_budget(PatchOptions(budget=1000), (x, x[2:]), {"t": torch.zeros(3)}, CPU) == 1000 + 160 + 12

    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher()
    stock = sample_call(base, x, cond)
    room = 768 * 64 * 4 * 6        # the forward planned whole: its rows, K + V, and as much again for the chunks
    patched = sc.patch(base, budget=room, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    chunks = [int(line.split("chunk=")[1].split()[0]) for line in text.splitlines() if "L1 rows=768 chunk=" in line]
    assert len(chunks) == 2 and all(c < 768 for c in chunks), text


def test_each_sampling_run_plans_again(fresh_captures):
    """Calls at the first sigma of a schedule (after a call at another sigma) start a new run: the blocks plan
    again there, with what is free then; cond and uncond calls at one sigma stay in one run."""
    import streamplan.integrations.comfy as sc
    base, x, cond = wan_patcher(layers=1)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    schedule = torch.tensor([0.9, 0.5, 0.0])
    streamers = []
    for sigma in (0.9, 0.9, 0.5, 0.9, 0.5):
        options = patched.model_options["transformer_options"].copy()
        options.update(cond_or_uncond=[0], sigmas=torch.tensor([sigma]), sample_sigmas=schedule)
        with torch.no_grad():
            patched.model.apply_model(x, torch.tensor([sigma]), transformer_options=options, **cond)
        streamers.append(next(iter(sc.patch.__globals__["_states"](patched)[0].blocks.values())).streamer)
    assert streamers[0] is streamers[1] is streamers[2] and streamers[3] is streamers[4]
    assert streamers[2] is not streamers[3]
    assert "2 sampling run(s) planned" in sc.report(patched)


def test_grid_chunk_bounds_cover_rows_in_order():
    """The model forward's own row chunks over a patched video grid: whole frames where a frame fits, else bands of
    grid rows of one frame; contiguous, in row order, within the chunk."""
    from streamplan.integrations.comfy.forwards import grid_chunk_bounds
    for grid, chunk in (((3, 4, 5), 40), ((3, 4, 5), 7), ((2, 3, 3), 100), ((1, 6, 4), 8)):
        at = 0
        for (t0, t1), (h0, h1), (a, b) in grid_chunk_bounds(grid, chunk):
            assert a == at and b - a == (t1 - t0) * (h1 - h0) * grid[2] and b - a <= max(chunk, grid[2])
            assert a == t0 * grid[1] * grid[2] + h0 * grid[2]
            at = b
        assert at == grid[0] * grid[1] * grid[2]


def test_h3_model_forward_text_tags(fresh_captures):
    """H3's presentation text tags (vision pads carry the video modality): the text rows' modulation runs per run of
    equal tags in the streamed forward as in the stock one."""
    import streamplan.integrations.comfy as sc
    base, x, cond = h3_patcher()
    payload = dict(cond["minimax_payload"])
    payload["text_token_tags"] = torch.tensor([[1, 1, 0, 0, 1, 2, 1]])
    cond = {**cond, "minimax_payload": payload}
    stock = sample_call(_h3_run(base), x, cond)
    run = _h3_run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert ": 1 call(s) streamed (" in sc.report(run)


def test_quantized_layouts_take_row_chunks_only(fresh_captures, monkeypatch):
    """A block holding a quantized layout (comfy.quant_ops.QuantizedTensor weights) is not planned under the budget
    (the planner may slice features): it streams at the fixed chunk, said in the report."""
    import streamplan.integrations.comfy as sc
    from streamplan.integrations.comfy.weights import quantized_layers
    patch_module = sys.modules["streamplan.integrations.comfy.patch"]   # the package's ``patch`` is the function

    class QuantizedTensor:   # what the check reads: the weight's class name
        pass

    class Layer(torch.nn.Module):
        comfy_cast_weights = False
        weight = None

    holder = torch.nn.Module()
    holder.fc, holder.plain = Layer(), torch.nn.Linear(2, 2)
    assert quantized_layers(holder) == []
    holder.fc.weight = QuantizedTensor()
    assert quantized_layers(holder) == ["fc"]

    base, x, cond = wan_patcher(layers=1)
    stock = sample_call(base, x, cond)
    monkeypatch.setattr(patch_module, "quantized_layers", lambda block: ["ffn.0"])
    patched = sc.patch(base, budget=768 * 64 * 4 * 4, chunk_tokens=128, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert "quantized weights (1 layer(s): ffn.0, ...): row chunks only" in text and "chunk=128" in text, text


def test_wan_i2v_model_forward(fresh_captures):
    """Wan image-to-video (CLIP image features through img_emb joined to the text, the I2V cross-attention's
    context_img_len): the streamed model forward and blocks, within fp32 rel 1e-5."""
    import streamplan.integrations.comfy as sc
    comfy = comfyui()
    unet = {"image_model": "wan2.1", "model_type": "i2v", "dim": 64, "ffn_dim": 128, "num_heads": 4,
            "num_layers": 2, "in_dim": 4, "out_dim": 4, "text_dim": 32, "freq_dim": 32, "eps": 1e-6,
            "patch_size": (1, 2, 2)}
    model = comfy.model_base.WAN21(_config(comfy, unet, comfy.latent_formats.Wan21))
    _random_(model)
    base = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    x, cond = torch.randn(1, 4, 3, 32, 32), {"c_crossattn": torch.randn(1, 7, 32), "clip_fea": torch.randn(1, 9, 1280)}
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert "model forward (WanModel): 1 call(s) streamed" in text and text.count("1 call(s) through the streamer") == 2


def test_blocks_stream_under_comfyui_selected_attention(fresh_captures):
    """ComfyUI started with another attention than PyTorch's (here split attention, ``--use-split-cross-attention``;
    Sage, flash and xformers are bound the same way and do not trace): the captures trace ComfyUI's PyTorch attention
    and every streamed chunk goes to the selected function. Wan and Flux stream, within 1e-5 of the stock model under
    that same attention."""
    comfyui()
    import comfy.ldm.modules.attention as attention

    from streamplan.integrations.comfy.capture_attention import _bound_to
    calls: list = []

    def selected(q, k, v, heads, **kwargs):
        calls.append(1)
        return attention.attention_split(q, k, v, heads, **kwargs)

    with _bound_to([attention.attention_pytorch], selected):
        for make, blocks in ((wan_patcher, 2), (flux_patcher, 4)):
            base, x, cond = make()
            calls.clear()
            sample_call(base, x, cond)
            stock_calls = len(calls)
            patched, text, keys = _stream_and_compare(base, x, cond)
            assert text.count("1 call(s) through the streamer") == blocks and "ran stock" not in text, text
            assert len(calls) > 2 * stock_calls, (len(calls), stock_calls)   # stock twice, then chunk by chunk
    assert attention.optimized_attention is not selected and "selected" not in repr(attention.optimized_attention)


def batch_call(patcher, x, cond):
    """One model call of a batch of ``x.shape[0]`` (cond and uncond together, as ComfyUI's CFG runs them)."""
    n = x.shape[0]
    options = {**patcher.model_options["transformer_options"], "cond_or_uncond": list(range(n)),
               "sigmas": torch.full((n,), 0.7)}
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.full((n,), 0.7), transformer_options=options, **cond)
