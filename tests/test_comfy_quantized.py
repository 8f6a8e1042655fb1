"""Quantized checkpoints as ComfyUI loads them (``comfy.ops.mixed_precision_ops`` with comfy_kitchen layouts), stock
against ``streamplan.integrations.comfy.patch``, on a real ComfyUI 0.33.0 (tests/comfy_support.py) and comfy_kitchen's
eager kernels: INT8 with ConvRot (MiniMax-H3's template checkpoint ``minimax_h3_fl2va_pruned_int8_convrot``) and W4A8
(the low-VRAM H3 workflow's ``pruned_w4a8_mixed``). The blocks' linears are quantized into a state dict carrying
ComfyUI's per-layer ``comfy_quant`` metadata and loaded through ComfyUI's own loader, so each layer holds a
``QuantizedTensor`` and runs comfy_kitchen's kernels, the MLP's down projection through ComfyUI's fused-activation
``linear_input_act`` (which calls ``comfy_kitchen.int8_linear`` directly)."""
from __future__ import annotations

import json

import pytest
import torch

import streamplan
from comfy_support import comfyui
from test_comfy import (_block_lines, _h3_run, fresh_captures, h3_patcher, ltxv_patcher,  # noqa: F401
                        sample_call, wan_patcher)

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_captures")
GROUP = 64   # ConvRot's Hadamard group: a power of 4 dividing every quantized layer's input features


def _quantized_entries(key: str, weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """One linear's weight as a quantized checkpoint stores it: the packed weight, its scales and ``comfy_quant``."""
    pre = key[:-len("weight")]
    if fmt == "int8_convrot":
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
        q, p = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=True,
                                             convrot_groupsize=GROUP)
        out = {key: q, pre + "weight_scale": p.scale}
        conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": GROUP}
    else:
        from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout
        q, p = AsymW4A8Int8Layout.quantize(weight, group_size=16, convrot_groupsize=GROUP)
        assert p.correction is None   # what ComfyUI's loader reads: no correction term
        out = {key: q, pre + "weight_s_rel": p.scale, pre + "weight_s_channel": p.s_channel}
        if p.codebook is not None:
            out[pre + "weight_codebook"] = p.codebook
        conf = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": GROUP}
    out[pre + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    return out


def _quantized(base, fmt: str):
    """``base``'s model again, its blocks' linears quantized and loaded through ComfyUI's mixed-precision ops."""
    comfy = comfyui()
    sd, qsd = base.model.diffusion_model.state_dict(), {}
    for key, value in sd.items():
        in_blocks = key.split(".")[0].endswith("blocks")   # blocks., transformer_blocks.
        if in_blocks and key.endswith(".weight") and value.dim() == 2 and value.shape[1] % GROUP == 0:
            qsd.update(_quantized_entries(key, value, fmt))
        else:
            qsd[key] = value
    config = base.model.model_config
    config.quant_config = comfy.utils.detect_layer_quantization(qsd, "")
    try:
        model = type(base.model)(config)
    finally:
        config.quant_config = None
    missing, unexpected = model.diffusion_model.load_state_dict(qsd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def _quantized_layers(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]


FAMILIES = {"h3": (h3_patcher, _h3_run), "wan": (wan_patcher, lambda p: p), "ltxv": (ltxv_patcher, lambda p: p)}


@pytest.mark.parametrize("fmt", ["int8_convrot", "w4a8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_blocks_stream_bit_exact(family, fmt):
    """Every block of a quantized model streams from its captured graph in 64-row chunks, bit-identical to ComfyUI's
    own forward on the same quantized weights (each row's activation is quantized on its own), the peak down; the
    quantized kernels are what ran (the output is not the float model's)."""
    import comfy_kitchen
    import streamplan.integrations.comfy as sc
    make, run = FAMILIES[family]
    float_base, x, cond = make()
    base = _quantized(float_base, fmt)
    layers = _quantized_layers(base.model.diffusion_model)
    assert any(".ffn." in n or ".mlp." in n or ".ff." in n for n in layers), layers   # the fused-activation path
    python_int8_linear = comfy_kitchen.int8_linear
    stock, stock_peak = streamplan.measure_peak(sample_call, run(base), x, cond)
    assert not torch.equal(stock, sample_call(run(float_base), x, cond))
    patched = run(sc.patch(base, budget=None, chunk_tokens=64, min_tokens=0))
    out, peak = streamplan.measure_peak(sample_call, patched, x, cond)
    assert torch.equal(out, stock)
    assert peak < stock_peak, (peak, stock_peak)
    assert comfy_kitchen.int8_linear is python_int8_linear   # the capture's stand-in is gone again
    text = sc.report(patched)
    sections = _block_lines(text)
    for key, _, _ in sc.block_keys(base.model.diffusion_model):
        name = f"{key[0]}.{key[1]}"
        assert "quantized weights" in sections[name] and "row chunks only" in sections[name], text
        assert "ran stock" not in sections[name] and "captured in" in sections[name], text


def test_a_quantized_budget_keeps_row_chunks_and_says_so():
    """Under a byte budget a quantized block is not planned (its kernels' transients are not in the memory model):
    it streams in row chunks and the report says the budget was not planned for it."""
    import streamplan.integrations.comfy as sc
    float_base, x, cond = h3_patcher()
    base = _quantized(float_base, "int8_convrot")
    stock = sample_call(_h3_run(base), x, cond)
    patched = _h3_run(sc.patch(base, budget="64MiB", chunk_tokens=64, min_tokens=0))
    assert torch.equal(sample_call(patched, x, cond), stock)
    text = sc.report(patched)
    assert "the budget is not planned" in text and "ran stock" not in text, text
