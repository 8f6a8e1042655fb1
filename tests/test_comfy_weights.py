"""Weights as ComfyUI holds them (streamplan/integrations/comfy/weights.py), against a real ComfyUI 0.33.0
(tests/comfy_support.py):
a model loaded by ComfyUI's own ``ModelPatcher.patch_model`` in lowvram mode (every comfy.ops layer casting its weights
per call, LoRA patches applied per call as ``LowVramPatch`` weight functions), stock against
``streamplan.integrations.comfy.patch``.
On a CPU machine the load and offload devices are both the CPU; how often each weight is taken is counted through
ComfyUI's own hook point for per-call weight functions (``ModelPatcher.add_weight_wrapper``).

DynamicVRAM (comfy-aimdo) cannot run here: ``ModelPatcherDynamic`` reroutes a CPU load device to the plain
``ModelPatcher`` and the VBAR is CUDA memory; ``benchmarks/gpu_comfy.py --dynamic-vram`` runs it on a GPU."""
from __future__ import annotations

import pytest
import torch

import streamplan
from comfy_support import comfyui
from conftest import rel_err
from test_comfy import (_block_lines, flux_patcher, fresh_captures, h3_patcher, hunyuan_video_patcher,  # noqa: F401
                        ltxv_patcher, sample_call, wan_patcher)

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_captures")   # every test starts without cached captures


class Count:
    """A weight wrapper (ComfyUI's ``add_weight_wrapper``): counts the casts of one weight, changes nothing."""

    def __init__(self):
        self.n = 0

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return w


def _lowvram(base, lora: dict[str, float], counted: list[str]) -> dict[str, Count]:
    """``base`` loaded the way ComfyUI loads a model that does not fit (``patch_model`` with 1 byte of lowvram room:
    every comfy.ops layer casts per call), with a LoRA-style diff patch on each weight of ``lora`` (applied per call,
    as ``LowVramPatch``) and a counting weight wrapper on each of ``counted``."""
    sd = base.model.state_dict()
    g = torch.Generator().manual_seed(1)
    for key, scale in lora.items():
        base.add_patches({key: (torch.randn(sd[key].shape, generator=g) * scale,)}, 1.0)
    counts = {key: Count() for key in counted}
    for key, c in counts.items():
        base.add_weight_wrapper(key, c)
    base.patch_model(CPU, lowvram_model_memory=1)
    return counts


def _layer(model, key: str):
    return model.get_submodule(key.rsplit(".", 1)[0])


def _stream_lowvram(base, x, cond, counts, keys, run=lambda p: p):
    """Stock, then streamed in 64-row chunks: the same output, the peak down, each counted weight taken once per block
    call in both, every block streamed, and the shared layers as they were after the call."""
    import streamplan.integrations.comfy as sc
    dm = base.model.diffusion_model
    before = {k: (_layer(base.model, k).weight, list(_layer(base.model, k).weight_function),
                  _layer(base.model, k).comfy_cast_weights) for k in keys}
    stock, stock_peak = streamplan.measure_peak(sample_call, run(base), x, cond)
    assert all(c.n == 1 for c in counts.values()), {k: c.n for k, c in counts.items()}
    patched = run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert all(c.n == 2 for c in counts.values()), {k: c.n for k, c in counts.items()}   # once in the streamed call
    assert peak < stock_peak, (peak, stock_peak)
    text = sc.report(patched)
    sections = _block_lines(text)
    for key, _, _ in sc.block_keys(dm):
        name = f"{key[0]}.{key[1]}"
        assert sections[name].startswith(f"  {name}: 1 call(s) through the streamer"), text
        assert "weights taken once per block call through comfy.ops.cast_bias_weight" in sections[name], text
        assert "chunk=64" in sections[name] and "ran stock" not in sections[name], text
    for k, (weight, functions, cast) in before.items():   # the shared layers hold their own weights again
        m = _layer(base.model, k)
        assert m.weight is weight and m.weight_function == functions and m.comfy_cast_weights == cast
    return patched, out, text


def test_wan_lowvram_lora_blocks_stream():
    """Wan blocks under lowvram, one with a LoRA patch applied per call and one without (one capture for both: the
    patch is in the weights taken for the call, never in the graph): equal to ComfyUI's own forward, every weight
    taken once per block call at 12 chunks, the patched weights' copies counted and reported."""
    comfyui()
    base, x, cond = wan_patcher(layers=2)
    lora = {"diffusion_model.blocks.1.self_attn.q.weight": 0.1, "diffusion_model.blocks.1.ffn.2.weight": 0.1}
    counted = ["diffusion_model.blocks.0.ffn.0.weight", "diffusion_model.blocks.1.self_attn.o.weight"]
    counts = _lowvram(base, lora, counted)
    q = base.model.diffusion_model.blocks[1].self_attn.q
    assert q.comfy_cast_weights and type(q.weight_function[0]).__name__ == "LowVramPatch"
    for n, m in base.model.named_modules():   # what ModelPatcherDynamic.load writes on each layer (GPU only)
        if hasattr(m, "comfy_cast_weights"):
            m.seed_key = n
    patched, out, text = _stream_lowvram(base, x, cond, counts, list(lora) + counted)
    # one capture serves both blocks: the patch and ComfyUI's per-layer bookkeeping are not in the graph
    import streamplan.graph as capture
    keys = [k for k, v in capture._CACHE.items() if type(v).__name__ == "Streamable"]
    assert len(keys) == 1, keys
    assert q.seed_key == "diffusion_model.blocks.1.self_attn.q"
    # the copies each call takes beyond ComfyUI's weights (a patched weight is a new tensor; the others are the
    # layers' own on this CPU machine): block 1's q, ffn.2 and o weights, block 0's ffn.0
    sections = _block_lines(text)
    d = base.model.diffusion_model
    mib = {0: d.blocks[0].ffn[0].weight.numel() * 4,
           1: (d.blocks[1].self_attn.q.weight.numel() + d.blocks[1].ffn[2].weight.numel()
               + d.blocks[1].self_attn.o.weight.numel()) * 4}
    for i, nbytes in mib.items():
        assert f"{nbytes / 2**20:.2f} MiB of cast weights held in the last call" in sections[f"double_block.{i}"], text
    # a patch changed after the capture (another LoRA on the same weight, ComfyUI's patch list read per call): the
    # next streamed call follows it, stock and streamed alike
    sd = base.model.state_dict()
    key = "diffusion_model.blocks.0.ffn.2.weight"
    base.add_patches({key: (torch.randn(sd[key].shape) * 0.5,)}, 1.0)
    base.unpatch_model(CPU)
    base.patch_model(CPU, lowvram_model_memory=1)
    stock = sample_call(base, x, cond)
    assert rel_err(stock, out) > 1e-2
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5


def test_h3_lowvram_lora_blocks_stream():
    """MiniMax-H3's DiTBlock under lowvram with a LoRA on its fused QKV and its MLP: equal to ComfyUI's own forward
    within fp32 1e-5, each weight taken once per block call; the q/k norm weights the block reads itself are left
    to it."""
    from test_comfy import _h3_run
    comfyui()
    base, x, cond = h3_patcher()
    lora = {"diffusion_model.blocks.0.attn.qkv_proj.weight": 0.1, "diffusion_model.blocks.1.mlp.fc1.weight": 0.1}
    counted = ["diffusion_model.blocks.0.mlp.fc2.weight", "diffusion_model.blocks.1.attn.out_proj.weight",
               "diffusion_model.blocks.1.adaln_proj.linear.weight"]
    counts = _lowvram(base, lora, counted)
    _, _, text = _stream_lowvram(base, x, cond, counts, list(lora) + counted, run=_h3_run)
    assert "attn.q_norm" not in text


@pytest.mark.parametrize("family", ["flux", "hunyuan_video", "ltxv"])
def test_other_dits_lowvram_lora_blocks_stream(family):
    """Flux's double and single stream blocks (also HunyuanVideo's) and LTX-Video's block under lowvram, a LoRA on
    the first block's modulation and attention projections: equal to ComfyUI's own forward, each weight taken once per
    block call."""
    comfyui()
    base, x, cond = {"flux": flux_patcher, "hunyuan_video": hunyuan_video_patcher, "ltxv": ltxv_patcher}[family]()
    first, last = ("transformer_blocks.0.", "transformer_blocks.1.") if family == "ltxv" else (
        "double_blocks.0.", "single_blocks.1.")
    sd = base.model.state_dict()
    matrices = [k for k in sd if k.endswith("weight") and sd[k].dim() == 2]
    lora = {k: 0.1 for k in [k for k in matrices if first in k][:3]}
    counted = [k for k in matrices if last in k][:1]
    _stream_lowvram(base, x, cond, _lowvram(base, lora, counted), list(lora) + counted)


def test_unknown_cast_ops_keep_the_block_stock():
    """A comfy.ops layer of a class whose cast path streamplan has not read (a custom node's ops: here a subclass
    with its own ``forward_comfy_cast_weights``) with a patch applied per call: that block runs stock, exactly, and
    says why; the other block streams. Without the patch (its weights on the device) its cast is traced as before."""
    comfy = comfyui()
    import streamplan.integrations.comfy as sc

    class NodeLinear(comfy.ops.manual_cast.Linear):
        def forward_comfy_cast_weights(self, input):
            weight, bias = comfy.ops.cast_bias_weight(self, input)
            return torch.nn.functional.linear(input, weight, bias)

    base, x, cond = wan_patcher(layers=2)
    layer = base.model.diffusion_model.blocks[1].ffn[0]
    layer.__class__ = NodeLinear
    try:
        stock = sample_call(base, x, cond)
        patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
        assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
        assert "1 call(s) stock" not in sc.report(patched)
        layer.weight_function = [lambda w: w * 2]
        stock = sample_call(base, x, cond)
        patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
        assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
        sections = _block_lines(sc.report(patched))
        assert sections["double_block.0"].startswith("  double_block.0: 1 call(s) through the streamer")
        assert "1 call(s) stock: ffn.0: weight patches applied per call on a layer streamplan does not take" \
            in sections["double_block.1"] and "NodeLinear" in sections["double_block.1"], sections
    finally:
        layer.__class__ = comfy.ops.disable_weight_init.Linear
        layer.__dict__.pop("weight_function", None)


def test_explicit_budget_pays_for_cast_weights():
    """An explicit budget is the activation room above what the call holds at entry (for a model forward planned
    whole, Wan here, above the forward's start), less the cast weights it takes; "auto" reads free memory after they
    were taken."""
    comfyui()
    from streamplan.integrations.comfy.memory import room_for, streamer_budget
    from streamplan.integrations.comfy.patch import Options as PatchOptions
    assert room_for(PatchOptions(budget=1000), CPU, taken=300) == 700
    assert room_for(PatchOptions(budget=1000), CPU, taken=3000) == 0
    x = torch.zeros(10, 4)
    assert streamer_budget(PatchOptions(budget=1000), (x,), {}, CPU, taken=100) == 900 + 160

    # a budget the block fits in with ComfyUI's own weights no longer fits once every weight is a patched copy
    import streamplan.integrations.comfy as sc
    room = 768 * 64 * 4 * 11 // 2   # the forward's rows, K + V and as much again for its work (768 rows, 64 wide)
    for lora in (False, True):
        base, x, cond = wan_patcher(layers=1)
        sd = base.model.state_dict()
        keys = [k for k in sd if ".blocks.0." in k and k.endswith("weight") and sd[k].dim() == 2] if lora else []
        _lowvram(base, {k: 0.01 for k in keys}, [])
        stock = sample_call(base, x, cond)
        patched = sc.patch(base, budget=room, min_tokens=0)
        if not lora:
            assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
            assert " rows=768 " in sc.report(patched)   # streamed (L1 or L3, near the smallest budget)
        else:
            with pytest.raises(streamplan.BudgetError, match="cannot hold"):
                sample_call(patched, x, cond)
            assert base.model.diffusion_model.blocks[0].ffn[0].comfy_cast_weights is True   # released on the error


@pytest.mark.parametrize("budget", [None, 64 * 2**20])
def test_taken_weights_are_released_after_the_call(budget):
    """The weights a call took are let go at its end (the peak of a second call is no higher than the first's), and
    the model's layers are left exactly as ComfyUI set them."""
    import streamplan.integrations.comfy as sc
    comfyui()
    base, x, cond = wan_patcher(layers=2)
    _lowvram(base, {"diffusion_model.blocks.0.ffn.0.weight": 0.1}, [])
    stock = sample_call(base, x, cond)
    patched = sc.patch(base, budget=budget, chunk_tokens=64 if budget is None else None, min_tokens=0)
    first, p1 = streamplan.measure_peak(sample_call, patched, x, cond)
    second, p2 = streamplan.measure_peak(sample_call, patched, x, cond)
    assert rel_err(first, stock) <= 1e-5 and torch.equal(first, second)
    assert p2 <= p1, (p1, p2)
    m = base.model.diffusion_model.blocks[0].ffn[0]
    assert "comfy_cast_weights" in m.__dict__ and m.comfy_cast_weights is True
    assert type(m.weight_function[0]).__name__ == "LowVramPatch"


class _OddWeight(torch.nn.Parameter):
    """A weight format ``weights.py`` does not take (not a plain tensor): its layer keeps its own cast per chunk."""


@pytest.mark.parametrize("family", ["wan", "hunyuan_video"])
def test_row_loops_cast_each_weight_once_per_call(family):
    """The streamed model forward's row loops (patch embedding, output head) under lowvram with a LoRA on them: each
    of their weights cast once per model call, not once per chunk (12 chunks for Wan's 768 rows, 3 for
    HunyuanVideo's 192), equal to ComfyUI's own forward, the layers as ComfyUI left them after the call. A weight in
    a format weights.py does not take keeps its layer's own call (cast once per chunk), the output the same."""
    import streamplan.integrations.comfy as sc
    comfyui()
    base, x, cond = {"wan": wan_patcher, "hunyuan_video": hunyuan_video_patcher}[family]()
    d = "diffusion_model."
    keys = ([d + "patch_embedding.weight", d + "head.head.weight"] if family == "wan" else
            [d + "img_in.proj.weight", d + "final_layer.linear.weight", d + "final_layer.adaLN_modulation.1.weight"])
    chunks = {"wan": 12, "hunyuan_video": 3}[family]
    counts = _lowvram(base, {k: 0.1 for k in keys}, keys)
    layers = {k: _layer(base.model, k) for k in keys}
    before = {k: (m.weight, list(m.weight_function), m.comfy_cast_weights) for k, m in layers.items()}
    stock = sample_call(base, x, cond)
    assert all(c.n == 1 for c in counts.values()), {k: c.n for k, c in counts.items()}
    patched = sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0)
    out = sample_call(patched, x, cond)
    assert rel_err(out, stock) <= 1e-5
    assert all(c.n == 2 for c in counts.values()), {k: c.n for k, c in counts.items()}   # once in the streamed call
    text = sc.report(patched)
    assert "1 call(s) streamed (input projection and output head in 64-row chunks" in text, text
    assert f"{len(keys)} comfy.ops layer(s) of its row loops cast per call: weights taken once per loop" in text, text
    for k, m in layers.items():
        weight, functions, cast = before[k]
        assert m.weight is weight and m.weight_function == functions and m.comfy_cast_weights == cast
        assert not m._forward_pre_hooks

    # a head weight in a format weights.py does not take: that layer casts once per chunk, as before
    head = layers[keys[1]]
    head.weight = _OddWeight(head.weight.detach(), requires_grad=False)
    stock = sample_call(base, x, cond)
    n = {k: c.n for k, c in counts.items()}
    assert rel_err(sample_call(patched, x, cond), stock) <= 1e-5
    assert counts[keys[0]].n == n[keys[0]] + 1 and counts[keys[1]].n == n[keys[1]] + chunks, (n, counts)
