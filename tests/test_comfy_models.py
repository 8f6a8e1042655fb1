"""streamplan.integrations.comfy's streamed model forwards of ComfyUI 0.33.0's Flux, HunyuanVideo and LTX-Video
(``streamplan/integrations/comfy/forwards_joint.py``, ``forwards_ltxv.py``): tiny random-weight models in real
``BaseModel``s and
``ModelPatcher``s, whole ``apply_model`` calls as ComfyUI samples them, stock against ``patch``."""
from __future__ import annotations

import copy

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import (_attention_spy, _block_lines, _forwards_installed, _without_wrapper, flux_patcher,
                        fresh_captures, hunyuan_video_patcher, ltxv_patcher, sample_call)

__all__ = ["fresh_captures"]   # the fixture, used by name


def _long(family: str):
    """(patcher, x, cond, its block list) with 4096 image rows (chunk transients small beside the rows)."""
    if family == "flux":
        base, _, cond = flux_patcher()
        return base, torch.randn(1, 4, 128, 128), cond, "double_blocks"
    if family == "hunyuan_video":
        base, _, cond = hunyuan_video_patcher()
        return base, torch.randn(1, 4, 4, 64, 64), cond, "double_blocks"
    base, _, cond = ltxv_patcher()
    return base, torch.randn(1, 8, 4, 32, 32), cond, "transformer_blocks"


def _first_block_inputs(patcher, x, cond, blocks: str) -> dict:
    """What the stock forward hands its first block (measured with a pre-hook): the rows it sees and the bytes of the
    rope table (and mask) every block reads, which the streamed forward keeps as the stock one does."""
    seen = {}

    def hook(_module, args, kwargs):
        img = kwargs.get("img", args[0] if args else None)
        txt = kwargs.get("txt")
        seen["rows"] = img.shape[1] + (txt.shape[1] if txt is not None else 0)
        pe = kwargs["pe"]
        tables = [t for t in (pe if isinstance(pe, tuple) else (pe,)) if isinstance(t, torch.Tensor)]
        seen["shared"] = sum(t.numel() * t.element_size() for t in tables)
    handle = getattr(patcher.model.diffusion_model, blocks)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        sample_call(patcher, x, cond)
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("family", ["flux", "hunyuan_video", "ltxv"])
def test_model_forward_streams_to_the_blocks_floor(fresh_captures, family):
    """The whole apply_model call through patch(): the model forward streamed (Flux and HunyuanVideo on one joint
    text+image buffer, so the stock join never makes a second residual; every block's input donated; the final layer
    on row chunks), within fp32 rel 1e-5 of stock, its peak near the blocks' floor (residual + K + V of every row, and
    the rope table the blocks read). Measured at 256-row chunks: Flux 1.21x, HunyuanVideo 1.20x, LTX-Video 1.10x of
    that floor (stock 3.70x, 3.63x, 2.84x; the blocks streamed under the stock forward 1.87x, 1.80x, 1.54x)."""
    import streamplan.integrations.comfy as sc
    base, x, cond, blocks = _long(family)
    before = copy.copy(base.model_options["transformer_options"])
    seen = _first_block_inputs(base, x, cond, blocks)
    stock, stock_peak = streamplan.measure_peak(sample_call, base, x, cond)
    patched = sc.patch(base, budget=None, chunk_tokens=256, min_tokens=0)
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    text = sc.report(patched)
    blocks_only, blocks_peak = streamplan.measure_peak(sample_call, _without_wrapper(patched), x, cond)
    assert rel_err(blocks_only, stock) <= 1e-5
    dm = base.model.diffusion_model
    width = dm.inner_dim if family == "ltxv" else dm.hidden_size
    floor = seen["rows"] * 3 * width * 4 + seen["shared"]        # residual + K + V (fp32) + the rope table
    ratio = peak / floor
    print(f"{family}: whole apply_model peak / blocks' floor {ratio:.2f} (stock {stock_peak / floor:.2f}, blocks "
          f"alone streamed {blocks_peak / floor:.2f})")
    assert ratio <= 1.3, (ratio, peak, floor)
    assert peak < 0.8 * blocks_peak and peak < 0.4 * stock_peak, (peak, blocks_peak, stock_peak)
    blocks_n = len(sc.block_keys(dm))
    assert f"model forward ({type(dm).__name__}): 1 call(s) streamed (input projection and output head in 256-row " \
        f"chunks, {blocks_n} block input(s) donated in the last)" in text, text
    assert text.count("1 call(s) through the streamer") == blocks_n and "ran stock" not in text, text
    assert base.model_options["transformer_options"] == before
    assert "wrappers" not in base.model_options["transformer_options"]
    assert _forwards_installed(base.model) == []


@pytest.mark.parametrize("family", ["flux", "hunyuan_video", "ltxv"])
def test_chunks_attend_through_comfy_optimized_attention(fresh_captures, monkeypatch, family):
    """Every streamed Q chunk of every block goes to ``comfy.ldm.modules.attention.optimized_attention`` (what
    ComfyUI selected at start-up); the stock blocks' own imports keep theirs."""
    comfyui()
    import comfy.ldm.modules.attention as attention

    import streamplan.integrations.comfy as sc
    calls: list = []
    patcher, x, cond = {"flux": flux_patcher, "hunyuan_video": hunyuan_video_patcher, "ltxv": ltxv_patcher}[family]()
    stock = sample_call(patcher, x, cond)
    monkeypatch.setattr(attention, "optimized_attention", _attention_spy(calls))
    if family != "ltxv":   # Flux's blocks took their own reference at import: the stock run never saw the spy
        assert calls == []
    calls.clear()
    patched = sc.patch(patcher, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    calls = [c for c in calls if type(c) is int]   # LTX-Video's capture traced its attention through the spy too
    if family == "flux":   # 9 text + 576 image rows: the text rows join a double block's first chunk
        assert calls == ([73] + [64] * 8) * 2 + ([64] * 9 + [9]) * 2, calls
    elif family == "hunyuan_video":   # 9 text + 192 image rows
        assert calls == [73, 64, 64] * 2 + [64, 64, 64, 9] * 2, calls
    else:                  # 768 rows; the cross-attention to the text is row-local, replayed from the graph (as Wan's)
        assert calls == [64] * 12 * 2, calls
    assert sc.report(patched).count("attention chunks to ComfyUI optimized_attention") == len(
        sc.block_keys(patcher.model.diffusion_model))


def test_flux_foreign_replacements_and_controlnet(fresh_captures):
    """Inside the joint buffer: a foreign block replacement that returns new tensors (its output copied back into
    the rows) and ControlNet's additions to the image rows after double and single blocks, exact against stock."""
    import streamplan.integrations.comfy as sc
    base, x, cond = flux_patcher()
    calls = []

    def foreign(args, extra):
        calls.append(sorted(args))
        out = extra["original_block"](args)
        return {k: v.clone() + 0.01 for k, v in out.items()}

    other = base.clone()
    other.set_model_patch_replace(foreign, "dit", "double_block", 0)
    other.set_model_patch_replace(foreign, "dit", "single_block", 1)
    g = torch.Generator().manual_seed(3)
    control = {"input": [torch.randn(1, 576, 64, generator=g), None],
               "output": [None, torch.randn(1, 500, 64, generator=g)]}
    run = {**cond, "control": control}
    stock = sample_call(other, x, run)
    calls.clear()
    patched = sc.patch(other, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, run), stock) <= 1e-5
    assert len(calls) == 2
    text = sc.report(patched)
    assert "1 call(s) streamed (input projection and output head in 64-row chunks, 2 block input(s) donated" in text
    sections = _block_lines(text)
    assert sc.LEFT_TO_EXISTING in sections["double_block.0"] and sc.LEFT_TO_EXISTING in sections["single_block.1"]
    assert "1 call(s) through the streamer" in sections["double_block.1"], text


@pytest.mark.parametrize("family", ["flux", "hunyuan_video", "ltxv", "chroma"])
def test_cond_and_uncond_in_one_batch(fresh_captures, family):
    """A batch of 2 (ComfyUI runs cond and uncond together under CFG): exact against stock, every block streamed
    (the joint models' image rows reach the double blocks contiguous and join their text rows in place after)."""
    import streamplan.integrations.comfy as sc
    patcher, x, cond = {"flux": flux_patcher, "hunyuan_video": hunyuan_video_patcher, "ltxv": ltxv_patcher,
                        "chroma": lambda: _generic("chroma")}[family]()
    g = torch.Generator().manual_seed(4)
    x2 = torch.cat([x, torch.randn(x.shape, generator=g)])
    cond2 = {k: torch.cat([v, torch.randn(v.shape, generator=g)]) if isinstance(v, torch.Tensor) else v
             for k, v in cond.items()}

    def call(p):
        options = {**p.model_options["transformer_options"], "cond_or_uncond": [0, 1],
                   "sigmas": torch.tensor([0.7, 0.7])}
        with torch.no_grad():
            return p.model.apply_model(x2, torch.tensor([0.7, 0.7]), transformer_options=options, **cond2)

    stock = call(patcher)
    patched = sc.patch(patcher, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(call(patched), stock) <= 1e-5
    text = sc.report(patched)
    assert "1 call(s) streamed" in text and "ran stock" not in text, text
    assert text.count("1 call(s) through the streamer") == len(sc.block_keys(patcher.model.diffusion_model)), text


@pytest.mark.parametrize("variant", ["flux2", "ovis"])
def test_flux_variants(fresh_captures, variant):
    """The Flux forward's other configurations, as ComfyUI's model detection sets them: Flux 2 (global modulation
    tables handed to the blocks as ``ModulationOut`` records, SiLU-gated MLP, no biases, text position ids, 4 rope
    axes, no pooled vector) and Ovis (YaK MLP, a norm on the text, 2 text id axes): exact against stock, every block
    streamed."""
    comfy = comfyui()
    import streamplan.integrations.comfy as sc
    from test_comfy import _config, _random_
    unet = {"image_model": "flux", "in_channels": 4, "out_channels": 4, "vec_in_dim": None, "context_in_dim": 32,
            "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 1, "depth_single_blocks": 1,
            "theta": 10000, "patch_size": 2, "qkv_bias": False, "guidance_embed": False}
    if variant == "flux2":
        unet.update(axes_dim=[4, 4, 4, 4], global_modulation=True, mlp_silu_act=True, ops_bias=False,
                    txt_ids_dims=[3])
    else:
        unet.update(axes_dim=[4, 6, 6], yak_mlp=True, txt_norm=True, txt_ids_dims=[1, 2])
    base = comfy.model_base.Flux(_config(comfy, unet, comfy.latent_formats.Flux))
    _random_(base)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    x, cond = torch.randn(1, 4, 32, 32), {"c_crossattn": torch.randn(1, 9, 32)}
    stock = sample_call(patcher, x, cond)
    patched = sc.patch(patcher, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert "model forward (Flux): 1 call(s) streamed" in text, text
    assert text.count("1 call(s) through the streamer") == 2 and "ran stock" not in text, text


def test_hunyuan_video_15_inputs(fresh_captures):
    """HunyuanVideo 1.5's text-side inputs under the streamed forward: the condition-type embedding, ByT5 rows and
    vision rows joined to the text, and meanflow's second timestep (the next sigma of the run), exact against stock,
    every block streamed."""
    comfy = comfyui()
    import streamplan.integrations.comfy as sc
    from test_comfy import _config, _conds, _random_
    unet = {"image_model": "hunyuan_video", "in_channels": 4, "out_channels": 4, "vec_in_dim": 16,
            "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 1,
            "depth_single_blocks": 1, "axes_dim": [4, 6, 6], "theta": 256, "patch_size": [1, 2, 2],
            "qkv_bias": True, "guidance_embed": False, "byt5": True, "meanflow": True,
            "use_cond_type_embedding": True, "vision_in_dim": 8, "meanflow_sum": True}
    base = comfy.model_base.HunyuanVideo(_config(comfy, unet, comfy.latent_formats.HunyuanVideo))
    _random_(base)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    patcher.model_options.setdefault("transformer_options", {})["sample_sigmas"] = torch.tensor([1.0, 0.7, 0.3, 0.0])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 3, 16, 16, generator=g)
    cond = _conds(base, cross_attn=torch.randn(1, 9, 32, generator=g), pooled_output=torch.randn(1, 16, generator=g))
    cond.update(txt_byt5=torch.randn(1, 5, 1472, generator=g), clip_fea=torch.randn(1, 4, 8, generator=g))
    stock = sample_call(patcher, x, cond)
    no_extras = sample_call(patcher, x, {k: v for k, v in cond.items() if k not in ("txt_byt5", "clip_fea")})
    assert rel_err(no_extras, stock) > 1e-3   # the inputs reach the output
    patched = sc.patch(patcher, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    text = sc.report(patched)
    assert "model forward (HunyuanVideo): 1 call(s) streamed" in text, text
    assert text.count("1 call(s) through the streamer") == 2 and "ran stock" not in text, text


def test_model_forwards_fail_closed(fresh_captures, monkeypatch):
    """What the streamed forwards do not cover runs the stock forward (its blocks still stream), exactly, with the
    reason: code that is not ComfyUI 0.33.0's (a final layer, a patch embedding), reference latents, a subclass with
    its own forward; keyframes, guiding frames, reference latents (judged on the call's arguments)."""
    comfyui()
    import comfy.ldm.flux.layers as flux_layers
    import comfy.ldm.lightricks.model as ltx
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit

    import streamplan.integrations.comfy as sc
    base, x, cond = flux_patcher()
    g_ref = torch.randn(1, 4, 16, 16)
    stock_ref = sample_call(base, x, {**cond, "ref_latents": [g_ref]})
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(run, x, {**cond, "ref_latents": [g_ref]}), stock_ref) <= 1e-5
    text = sc.report(run)
    assert "1 call(s) stock: ref_latents are given" in text and text.count("through the streamer") == 4, text

    stock_last = flux_layers.LastLayer.forward

    def forward(self, *args, **kwargs):
        return stock_last(self, *args, **kwargs)

    monkeypatch.setattr(flux_layers.LastLayer, "forward", forward)
    stock = sample_call(base, x, cond)
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert "1 call(s) stock: LastLayer.forward is not the code streamplan follows (ComfyUI 0.33.0's)" in \
        sc.report(run), sc.report(run)
    monkeypatch.undo()

    base, x, cond = hunyuan_video_patcher()
    stock_embed = mmdit.PatchEmbed.forward

    def embed(self, x):
        return stock_embed(self, x)

    monkeypatch.setattr(mmdit.PatchEmbed, "forward", embed)
    stock = sample_call(base, x, cond)
    run = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert "comfy.ldm.modules.diffusionmodules.mmdit:PatchEmbed.forward is not the code streamplan follows" in \
        sc.report(run), sc.report(run)
    monkeypatch.undo()

    class OwnForwardLTXV(ltx.LTXVModel):
        def _forward(self, *args, **kwargs):
            return super()._forward(*args, **kwargs)

    sub, x, cond = ltxv_patcher()
    sub.model.diffusion_model.__class__ = OwnForwardLTXV
    stock = sample_call(sub, x, cond)
    run = sc.patch(sub, budget=None, chunk_tokens=64, min_tokens=0)
    assert rel_err(sample_call(run, x, cond), stock) <= 1e-5
    assert "OwnForwardLTXV is a subclass of LTXVModel with its own forward" in sc.report(run)

    from streamplan.integrations.comfy.forwards_joint import HunyuanVideo
    from streamplan.integrations.comfy.forwards_ltxv import LTXV
    hv = hunyuan_video_patcher()[0].model.diffusion_model
    video = torch.zeros(1, 4, 1, 4, 4)
    assert "keyframe_idxs are given" in LTXV.problem(None, {"x": video, "keyframe_idxs": torch.zeros(1, 3, 2, 2)})
    assert "a guiding frame" in HunyuanVideo.problem(hv, {"x": video, "guiding_frame_index": torch.zeros(1)})
    assert "a reference latent" in HunyuanVideo.problem(hv, {"x": video, "ref_latent": video})


def _generic(family: str):
    """A ComfyUI DiT with no streamed forward of its own: Qwen-Image (its ``transformer_blocks``, joint text+image
    attention) and Chroma (Flux's blocks, modulation handed in as ``ChromaModulationOut`` dataclasses)."""
    comfy = comfyui()
    from test_comfy import _config, _random_
    if family == "qwen_image":
        unet = {"image_model": "qwen_image", "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2,
                "attention_head_dim": 16, "num_attention_heads": 4, "joint_attention_dim": 32,
                "axes_dims_rope": (4, 6, 6)}
        base = comfy.model_base.QwenImage(_config(comfy, unet, comfy.latent_formats.Wan21))
        x, cond = torch.randn(1, 4, 1, 48, 48), {"c_crossattn": torch.randn(1, 7, 32)}
    else:
        unet = {"image_model": "chroma", "in_channels": 16, "out_channels": 16, "context_in_dim": 32,
                "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
                "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64,
                "out_dim": 64, "hidden_dim": 32, "n_layers": 2, "txt_ids_dims": [], "vec_in_dim": 16}
        base = comfy.model_base.Chroma(_config(comfy, unet, comfy.latent_formats.Flux))
        x, cond = torch.randn(1, 4, 48, 48), {"c_crossattn": torch.randn(1, 7, 32), "guidance": torch.zeros(1)}
    _random_(base)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu), x, cond


def test_generic_path_for_other_dits(fresh_captures):
    """Other DiTs whose forwards hand their blocks to "dit" replacements get them through the generic captured-graph
    path: Qwen-Image's blocks stream (its model forward is stock, said in the report), and Chroma's (Flux's blocks,
    their modulation handed in as ``ChromaModulationOut`` records, ``recognize/comfy_flux.py``) under Chroma's
    streamed forward (``forwards_joint.Chroma``: per-block modulation, a block in ``skip_mmdit`` skipped as stock
    skips it), exact against stock, peak down."""
    import streamplan.integrations.comfy as sc
    for family, blocks, rows in (("qwen_image", 2, [576, 576]), ("chroma", 4, [576, 576, 583, 583]),
                                 ("chroma_skip", 3, [576, 583, 583])):
        patcher, x, cond = _generic(family.split("_skip")[0])
        if family == "chroma_skip":
            patcher.model.diffusion_model.skip_mmdit = [1]
        stock, stock_peak = streamplan.measure_peak(sample_call, patcher, x, cond)
        patched = sc.patch(patcher, budget=None, chunk_tokens=64, min_tokens=0)
        out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
        assert rel_err(out, stock) <= 1e-5
        assert peak < 0.75 * stock_peak, (family, peak, stock_peak)
        text = sc.report(patched)
        assert text.count("1 call(s) through the streamer") == blocks and "ran stock" not in text, text
        assert [int(t.split()[0]) for t in text.split(": L1 rows=")[1:]] == rows, text
        name = type(patcher.model.diffusion_model).__name__
        if family == "qwen_image":
            assert f"{name} has no streamed model forward in streamplan (its blocks still stream)" in text, text
        else:
            assert f"model forward ({name}): 1 call(s) streamed" in text, text
