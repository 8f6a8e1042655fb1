"""H200: streamplan.integrations.comfy.patch on a real ComfyUI 0.33.0 (.vendor/comfyui) WanModel, 1 layer at Wan2.1-14B
width, bf16.

Whole ``BaseModel.apply_model`` calls as ComfyUI's samplers make them: stock (the plain ModelPatcher) against ``patch``
(a) at fixed 16384-token chunks, (b) with the budget held to 1.15x the block's floor (residual + K + V), (c) as (a) with
patch's ``DIFFUSION_MODEL`` wrapper taken out (the blocks stream under the stock model forward, as before the wrapper:
the model's fp32 patch embedding / projection and head over all rows, block inputs not donated). Per row: peak
KB/token of the whole call above what was allocated before it (inputs, weights), the same against the floor, median
time of 2 after a warm-up, relative difference to stock, ``streamplan.integrations.comfy.report``. Budget (b): inside
ComfyUI an explicit budget is the activation room above what a block call holds when it is entered
(``streamplan/integrations/comfy/memory.py``), so (b) passes 1.15 x floor; the wrapper's own row loops (patch
embedding, head)
take chunks a quarter of that room holds.

    python benchmarks/gpu_comfy.py --tokens 217088
    python benchmarks/gpu_comfy.py --smoke          # tiny sizes on CPU: the script end to end

``--blocks`` (``comfy_blocks.py``): the issue's criterion is of the block call, so each block call inside these whole
calls is measured too: its peak above what was allocated at its entry against the floor (``block_peak_vs_floor``;
with a donated input the residual it overwrites is in that entry, ``..._with_donated_residual_vs_floor`` adds it
back) and its time against the stock block's (``block_time_ratio``); modes stock, (a) and (b) (and ``auto`` off the
device). Why (b)'s whole Wan call peaks above (a)'s (1.46x against 1.21x the floor): (b)'s room is above the block's
entry, where the donated residual already is, so the planner takes the largest chunk whose K + V + transients fill
1.15x the floor (measured on CPU with the meter, Wan at width 256, 8192 rows, bf16: 1536-row chunks against (a)'s
512, block 1.17x against 0.84x the floor above its entry, the whole call 2.00x against 1.67x: the same 0.33); the
forward holds the residual and the rope table besides. Written to ``..._blocks.json``.

    python benchmarks/gpu_comfy.py --blocks --tokens 217088
    python benchmarks/gpu_comfy.py --blocks --smoke

``--model h3``: ComfyUI's MiniMax-H3 (``comfy.model_base.MiniMaxH3``, ``comfy.ldm.minimax``), 1 DiTBlock at real width
(hidden 5376, 56 heads x 128, SwiGLU 14336; token refiner and embedders as shipped), bf16, sampled the way ComfyUI
samples its packed audio-video latent: ``comfy.utils.pack_latents([video, audio])``, conditioning from
``BaseModel.extra_conds`` (refined text, ``latent_shapes``, the packed layout), sampling settings of
``comfy.supported_models.MiniMaxH3`` (shift 12, audio_shift 3). ``--tokens`` counts every packed row the block sees:
text (``--text``, 512) + audio (``--audio``, 2000: stereo, 1000 latent frames) + video rows (the 2x2-patched grid
closest to the rest). Floor: residual + K + V = (5376 + 2 x 7168) x 2 bytes = 38.5 KB per row. Written to
gpu_comfy_h3_<rows>.json.

    python benchmarks/gpu_comfy.py --model h3 --tokens 217088   # 512 text + 2000 audio + 106x44x46 video = 217056
    python benchmarks/gpu_comfy.py --model h3 --smoke

``--weights``: where ComfyUI holds the weights (``streamplan/integrations/comfy/weights.py`` takes each once per block
call).
``device`` (default): on the GPU. ``lowvram``: built on the CPU, loaded by ``ModelPatcher.patch_model`` with 1 byte of
lowvram room, as ComfyUI loads a model that does not fit: every comfy.ops layer keeps its weights on the CPU and casts
them to the GPU per call. ``dynamic``: DynamicVRAM, ComfyUI 0.33.0's default on NVIDIA, set up as its main.py does
(``comfy_aimdo.control.init`` before ComfyUI imports, ``init_device``, ``aimdo_enabled``), the model built on the CPU
and loaded by ``load_models_gpu`` through a ``ModelPatcherDynamic``; the VBAR's memory is outside PyTorch's allocator,
so the peaks count activations and cast copies. ``--lora S``: a LoRA-style diff patch of scale S on every block's
attention output and first FFN/MLP weight, applied per call by ComfyUI (``LowVramPatch``) under lowvram and DynamicVRAM.
Written to gpu_comfy[_h3]_<weights>[_lora]_<rows>.json.

    python benchmarks/gpu_comfy.py --weights lowvram --lora 0.01 --tokens 217088
    python benchmarks/gpu_comfy.py --weights dynamic --lora 0.01 --tokens 217088
    python benchmarks/gpu_comfy.py --model h3 --weights dynamic --lora 0.01 --tokens 217088
    python benchmarks/gpu_comfy.py --weights lowvram --lora 0.01 --smoke   # CPU: lowvram casts end to end

``--model flux|hunyuan_video|ltxv|chroma`` (``comfy_dits.py``): ComfyUI's Flux (1 double + 1 single block at Flux.1-dev
width, 3072 = 24 x 128), HunyuanVideo (the same blocks under its own forward, with a padded-text mask), LTX-Video
(1 block of the 2B model, 2048 = 32 x 64) and Chroma (Flux's blocks, modulation from its distilled guidance layer),
bf16, through their streamed model forwards (``forwards_joint.py``, ``forwards_ltxv.py``). ``--tokens`` counts the
rows a block sees (Flux, HunyuanVideo, Chroma: text + image rows). Also
written: ``rope_KB_per_token``, the rope table every block reads (built whole by the model forward, stock and
streamed).
Written to gpu_comfy_<model>_<rows>.json.

    python benchmarks/gpu_comfy.py --model flux --tokens 217088
    python benchmarks/gpu_comfy.py --model hunyuan_video --tokens 217088
    python benchmarks/gpu_comfy.py --model ltxv --tokens 217088
    python benchmarks/gpu_comfy.py --model chroma --tokens 217088
    python benchmarks/gpu_comfy.py --model ltxv --smoke
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import math
import os
import sys
import traceback
import types

import torch

import streamplan
import comfy_blocks
import comfy_dits
from common import cuda_peak, cuda_time, device_info, random_weights, wall_time, write_results
from streamplan.verify import compare_outputs

COMFY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".vendor", "comfyui")


class _Missing:   # handed out by the torchvision placeholder (as tests/comfy_support.py): fails when used
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise ImportError(f"{self._name}: torchvision is not installed (placeholder)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")


class _Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _Missing(spec.name).__getattr__
        return module

    def exec_module(self, module):
        return None


def _drop_torchvision():
    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        del sys.modules[name]


def import_comfy(cpu: bool, dynamic: bool = False):
    """ComfyUI's model code with PyTorch SDPA attention; a torchvision placeholder only where torchvision fails.
    ``dynamic``: comfy-aimdo initialised first, as ComfyUI's main.py does before it imports ComfyUI."""
    if dynamic:
        import comfy_aimdo.control
        if not comfy_aimdo.control.init():
            raise SystemExit("--weights dynamic: comfy_aimdo.control.init() failed (see the log above)")
    placeholder = None
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 -- missing, or a wheel that does not load beside this torch
        _drop_torchvision()
        for lib in ("transformers", "diffusers"):   # they note once whether torchvision exists: before the placeholder
            with contextlib.suppress(Exception):
                importlib.import_module(f"{lib}.utils.import_utils")
        placeholder = _Placeholder()
        sys.meta_path.insert(0, placeholder)
    sys.path.insert(0, os.path.abspath(COMFY))
    from comfy.cli_args import args
    args.cpu, args.use_pytorch_cross_attention = cpu, True    # before model_management and attention import
    for module in ("model_management", "model_patcher", "model_base", "latent_formats", "supported_models_base",
                   "ldm.wan.model", "ldm.modules.attention"):
        importlib.import_module(f"comfy.{module}")
    if placeholder is not None:   # ComfyUI keeps what it took; libraries imported later never see the placeholder
        sys.meta_path.remove(placeholder)
        _drop_torchvision()
    return sys.modules["comfy"]


def latent_grid(n: int, max_frames: int = 128) -> tuple[int, int, int]:
    """(frames, h, w) after the 2x2 patch with frames*h*w closest to n (then the squarest, then fewest frames)."""
    best = None
    for f in range(1, max_frames + 1):
        s = n / f
        for h in {max(1, math.floor(math.sqrt(s))), max(1, math.ceil(math.sqrt(s)))}:
            w = max(1, round(s / h))
            best = min(best or ((n, n, n), (f, h, w)), ((abs(f * h * w - n), abs(h - w), f), (f, h, w)))
    return best[1]


def enable_dynamic_vram(comfy) -> None:
    """The rest of main.py's DynamicVRAM set-up, after the model was built with its weights materialised (with
    ``aimdo_enabled`` on, comfy.ops layers are created empty for a state-dict load)."""
    import comfy_aimdo.control
    if not comfy_aimdo.control.init_device(comfy.model_management.get_torch_device().index):
        raise SystemExit("--weights dynamic: comfy_aimdo.control.init_device failed")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


# the weights --lora patches in every block: its attention output and first FFN/MLP matrix (Wan, MiniMax-H3, Flux and
# HunyuanVideo's double and single blocks, LTX-Video)
LORA_TARGETS = ("self_attn.o.weight", "ffn.0.weight", "attn.out_proj.weight", "mlp.fc1.weight", "img_attn.proj.weight",
                "img_mlp.0.weight", "linear1.weight", "attn1.to_out.0.weight", "ff.net.0.proj.weight")


def held_as(comfy, base, dev, weights: str, lora: float):
    """The ModelPatcher for ``base`` (built on the CPU unless ``weights`` is "device"), loaded the way ComfyUI loads it
    before sampling, with a LoRA-style patch of scale ``lora`` on every block's attention output and first FFN/MLP
    weight. Returns (patcher, a line saying how the weights are held)."""
    cpu = torch.device("cpu")
    if weights == "dynamic":
        enable_dynamic_vram(comfy)
        # the VBAR is made on the load device's index: "cuda" alone has none (ComfyUI's own device is "cuda:0")
        patcher = comfy.model_patcher.ModelPatcherDynamic(base, load_device=comfy.model_management.get_torch_device(),
                                                          offload_device=cpu)
    else:
        patcher = comfy.model_patcher.ModelPatcher(base, load_device=dev,
                                                   offload_device=dev if weights == "device" else cpu)
    if lora:
        sd = base.state_dict()
        keys = [k for k in sd if "blocks." in k and k.endswith(LORA_TARGETS)]
        g = torch.Generator().manual_seed(2)
        patcher.add_patches({k: (torch.randn(sd[k].shape, generator=g, dtype=torch.float32).to(sd[k].dtype) * lora,)
                             for k in keys}, 1.0)
    if weights == "lowvram":
        patcher.patch_model(dev, lowvram_model_memory=1)
    elif weights == "dynamic":
        comfy.model_management.load_models_gpu([patcher])
    elif lora:
        patcher.patch_model(dev)   # the patches merged into the weights on the device, as a full load does
    from streamplan.integrations.comfy import block_keys
    layers = [m for _, _, b in block_keys(base.diffusion_model) for m in b.modules()
              if hasattr(m, "comfy_cast_weights")]
    patched = sum(bool(getattr(m, "weight_function", None) or getattr(m, "weight_lowvram_function", None))
                  for m in layers)
    line = (f"{weights}: {sum(bool(m.comfy_cast_weights) for m in layers)} of {len(layers)} block comfy.ops layers "
            f"cast per call, {sum(hasattr(m, '_v') for m in layers)} in a DynamicVRAM VBAR, "
            f"{patched} with per-call weight patches (LoRA: "
            f"{lora or 'none'})")
    return patcher, line


def build(comfy, dev, dtype, smoke: bool, n: int, text: int, model_dev=None, layers: int = 1, init_dev=None):
    dims = (dict(dim=64, ffn_dim=128, num_heads=4, text_dim=32, freq_dim=32) if smoke else
            dict(dim=5120, ffn_dim=13824, num_heads=40, text_dim=4096, freq_dim=256))
    unet = {"image_model": "wan2.1", "model_type": "t2v", "num_layers": layers, "in_dim": 16, "out_dim": 16,
            "eps": 1e-6, "patch_size": (1, 2, 2), "dtype": dtype, **dims}

    class Config(comfy.supported_models_base.BASE):
        unet_config, unet_extra_config, sampling_settings = {}, {}, {"shift": 1.0}
        supported_inference_dtypes = [dtype]
        latent_format = comfy.latent_formats.Wan21
    base = comfy.model_base.WAN21(Config(unet), device=model_dev or dev)
    random_weights(base, device=init_dev)
    f, h, w = latent_grid(n)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, 16, f, 2 * h, 2 * w, device=dev, generator=g)
    context = torch.randn(1, text, dims["text_dim"], device=dev, dtype=dtype, generator=g)
    return base, x, lambda: {"c_crossattn": context}, (f, h, w), dims["dim"]


H3_DIMS = dict(hidden_size=5376, num_attention_heads=56, attention_head_dim=128, ffn_hidden_size=14336)
H3_SMOKE_DIMS = dict(hidden_size=64, num_attention_heads=2, attention_head_dim=32, ffn_hidden_size=128,
                     token_refiner_num_layers=1, text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64,
                     time_embed_dim=32, rope_inv_freq_len=4)


def build_h3(comfy, dev, dtype, smoke: bool, n: int, text: int, audio: int, model_dev=None, layers: int = 1,
             init_dev=None):
    """MiniMax-H3 with ``layers`` DiTBlocks; the packed latent (video then audio) and its conditioning as ComfyUI
    samples it. ``n`` counts every packed row: text + audio + video (video takes the patched grid closest to the
    rest)."""
    importlib.import_module("comfy.ldm.minimax.model")
    importlib.import_module("comfy.utils")
    dims = H3_SMOKE_DIMS if smoke else H3_DIMS
    unet = {"image_model": "minimax_h3", "num_layers": layers, "dtype": dtype, **dims}

    class Config(comfy.supported_models_base.BASE):   # comfy.supported_models.MiniMaxH3's sampling settings
        unet_config, unet_extra_config = {}, {}
        sampling_settings = {"shift": 12.0, "audio_shift": 3.0}
        supported_inference_dtypes = [dtype]
        latent_format = comfy.latent_formats.MiniMaxH3AV
    base = comfy.model_base.MiniMaxH3(Config(unet), device=model_dev or dev)
    model = base.diffusion_model
    random_weights(base, device=init_dev)
    with torch.no_grad():
        inv = model.rope.inv_freq                  # a buffer, left uninitialised like the weights
        inv.copy_(1.0 / 10000.0 ** (torch.arange(inv.numel(), device=inv.device, dtype=torch.float32) / inv.numel()))
    x, cond, grid, shapes = h3_call(comfy, base, dev, dtype, n, text, audio, dims.get("text_dim", 5120))
    widths = (dims["hidden_size"], dims["num_attention_heads"], dims["attention_head_dim"], dims["ffn_hidden_size"])
    return base, x, cond, grid, widths, shapes


def h3_call(comfy, base, dev, dtype, n: int, text: int, audio: int, text_dim: int):
    """A MiniMax-H3 call's packed latent (video then audio) and its conditioning (a function: run it after the load)
    at ``n`` packed rows, with its video grid and the two latents' shapes."""
    model = base.diffusion_model
    if audio % 2:
        raise SystemExit(f"--audio {audio}: stereo audio packs 2 rows per latent frame, give an even count")
    f, h, w = latent_grid(max(1, n - text - audio))
    g = torch.Generator(device=dev).manual_seed(1)
    video = torch.randn(1, model.latents_dim, f, 2 * h, 2 * w, device=dev, generator=g)
    sound = torch.randn(1, model.audio_latents_dim, 2, audio // 2, device=dev, generator=g)
    x, shapes = comfy.utils.pack_latents([video, sound])
    context = torch.randn(1, text, text_dim, device=dev, dtype=dtype, generator=g)
    # after the load (``held_as``): extra_conds runs the token refiner, whose weights the load puts in place
    cond = lambda: {k: v.cond for k, v in  # noqa: E731
                    base.extra_conds(device=dev, cross_attn=context, latent_shapes=shapes).items()}
    return x, cond, (f, h, w), (list(video.shape), list(sound.shape))


def sample_call(patcher, x, cond):
    """One model call as comfy.samplers.calc_cond_batch makes it."""
    options = patcher.model_options["transformer_options"].copy()
    options["cond_or_uncond"], options["sigmas"] = [0], torch.tensor([0.7], device=x.device)
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([0.7], device=x.device), transformer_options=options, **cond)


def block_input_bytes(patcher, x, cond) -> int:
    """Bytes of the distinct tensor storages blocks[0] receives (what BlockStreamer counts as its live inputs)."""
    seen: dict[int, int] = {}

    def hook(_module, args, kwargs):
        for v in [*args, *kwargs.values()]:
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    from streamplan.integrations.comfy import block_keys
    first = block_keys(patcher.model.diffusion_model)[0][2]
    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    sample_call(patcher, x, cond)
    handle.remove()
    return sum(seen.values())


BLOCK_MODES = {"chunk": 0, "held": 1, "held-residual": 2}   # --modes: which of the block calls' modes run


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive whole number, got {text!r}")
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=_positive, default=None, help="block sequence length (default 217088; smoke 4096)")
    p.add_argument("--text", type=_positive, default=None, help="text tokens (default 512; smoke 16)")
    p.add_argument("--chunk", type=_positive, default=None, help="chunk_tokens of mode (a) (default 16384; smoke 512)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    p.add_argument("--model", choices=("wan", "h3", *comfy_dits.MODELS), default="wan",
                   help="wan: WanModel (default); h3: MiniMax-H3, --tokens counting every packed row; flux, "
                        "hunyuan_video, ltxv, chroma: comfy_dits.py, --tokens counting the rows a block sees")
    p.add_argument("--audio", type=_positive, default=None, help="h3: audio rows, even (default 2000; smoke 80)")
    p.add_argument("--weights", choices=("device", "lowvram", "dynamic"), default="device",
                   help="where ComfyUI holds the weights: device (default), lowvram (on the CPU, cast per call), "
                        "dynamic (DynamicVRAM, comfy-aimdo; GPU only)")
    p.add_argument("--lora", type=float, default=0.0, help="scale of a LoRA-style patch ComfyUI applies per call")
    p.add_argument("--modes", default=None, help="with --blocks: a comma list of chunk, held, held-residual "
                   "(default all three; stock always runs)")
    p.add_argument("--blocks", action="store_true",
                   help="also each block call (comfy_blocks.py): its peak above its entry against the floor, its time "
                        "against the stock block's; modes stock, fixed chunks, held (and auto off the device)")
    a = p.parse_args()
    if a.weights == "dynamic" and a.smoke:
        p.error("--weights dynamic needs a GPU (comfy-aimdo's VBAR is CUDA memory); no --smoke")
    if a.audio is not None and a.audio % 2:
        p.error(f"--audio: an even number of audio rows, got {a.audio}")
    if a.modes is not None and not a.blocks:
        p.error("--modes chooses the block calls' modes: it needs --blocks")
    if a.modes and not set(a.modes.split(",")) <= set(BLOCK_MODES):
        p.error(f"--modes {a.modes!r}: choose from {', '.join(BLOCK_MODES)}")
    cuda, dtype = not a.smoke, torch.bfloat16
    n, text = a.tokens or (4096 if a.smoke else 217088), a.text or (16 if a.smoke else 512)
    chunk, dev = a.chunk or (512 if a.smoke else 16384), torch.device("cpu" if a.smoke else "cuda")
    info = device_info() if cuda else {"device": "cpu (smoke)", "torch": torch.__version__}
    print(info, flush=True)
    comfy = import_comfy(cpu=not cuda, dynamic=a.weights == "dynamic")
    model_dev = dev if a.weights == "device" else torch.device("cpu")
    import streamplan.integrations.comfy as sc
    if cuda:
        peak_of, time_of = cuda_peak, (lambda fn: cuda_time(fn, repeats=2))
    else:   # smoke on CPU: the profiler's peak, wall time
        peak_of, time_of = (lambda fn: streamplan.measure_peak(fn, device="cpu")), wall_time

    extra = {}
    held_tag = "" if a.weights == "device" and not a.lora else f"{a.weights}_{'lora_' if a.lora else ''}"
    if a.model == "h3":
        audio = a.audio if a.audio is not None else (80 if a.smoke else 2000)
        base_model, x, cond, (f, h, w), (dim, heads, head_dim, ffn), (vshape, ashape) = build_h3(
            comfy, dev, dtype, a.smoke, n, text, audio, model_dev)
        video_rows = f * h * w
        tokens = text + audio + video_rows
        print(f"video latent {vshape} -> {f} x {h} x {w} = {video_rows} video rows, audio latent {ashape} -> {audio} "
              f"rows, {text} text rows: {tokens} packed rows (asked {n}); packed latent {list(x.shape)}", flush=True)
        floor = tokens * (dim + 2 * heads * head_dim) * 2   # residual + K + V, bf16
        model = (f"comfy MiniMaxH3Model 1 layer (hidden {dim}, {heads} heads x {head_dim}, SwiGLU {ffn}), bf16, "
                 "ComfyUI 0.33.0 apply_model")
        latent, inputs_named = list(vshape), "h, t_emb, rope rotation table"
        extra = {"video_rows": video_rows, "audio_rows": audio, "text_rows": text, "video_latent": list(vshape),
                 "audio_latent": list(ashape), "packed_latent": list(x.shape),
                 "sampling": "ModelSamplingAV shift 12, audio_shift 3 (audio carried scaled onto the video schedule)"}
        name = f"gpu_comfy_h3_{'smoke_' if a.smoke else ''}{held_tag}{tokens}"
    elif a.model in comfy_dits.MODELS:
        base_model, x, cond, grid, tokens, dim, model, extra = comfy_dits.build(
            comfy, a.model, dev, dtype, a.smoke, n, text, latent_grid, model_dev)
        print(f"latent {list(x.shape)} -> grid {grid}: {tokens} rows a block sees (asked {n}), {text} text tokens",
              flush=True)
        floor = tokens * 3 * dim * 2   # residual + K + V, bf16
        model = f"{model}, bf16, ComfyUI 0.33.0 apply_model"
        latent, inputs_named = list(x.shape), "the first block's inputs (rows, text, modulation, rope table)"
        name = f"gpu_comfy_{a.model}_{'smoke_' if a.smoke else ''}{held_tag}{tokens}"
    else:
        base_model, x, cond, (f, h, w), dim = build(comfy, dev, dtype, a.smoke, n, text, model_dev)
        tokens = f * h * w
        print(f"latent {list(x.shape)} -> {f} x {h} x {w} = {tokens} block tokens (asked {n}), {text} text tokens",
              flush=True)
        floor = tokens * (dim + 2 * dim) * 2   # residual + K + V, bf16
        model = f"comfy WanModel 1 layer (dim {dim}), bf16, ComfyUI 0.33.0 apply_model"
        latent, inputs_named = list(x.shape), "x, context, e0, freqs"
        name = f"gpu_comfy_{'smoke_' if a.smoke else ''}{held_tag}{tokens}"
    if a.blocks:
        name += "_blocks"
        extra["comfy_kitchen_backends"] = comfy_blocks.kitchen_backends()
    stock, held = held_as(comfy, base_model, dev, a.weights, a.lora)
    cond = cond()
    print(held, flush=True)
    extra["weights"] = held
    inputs = block_input_bytes(stock, x, cond)
    if a.model in comfy_dits.MODELS:
        rope = comfy_dits.rope_bytes(stock, x, cond, sample_call)
        extra.update(rope_KB_per_token=rope / tokens / 1024, rope_note="the rope table every block reads, built "
                     "whole by the model forward (stock and streamed)")
    budget = int(1.15 * floor)
    kb = lambda b: b / tokens / 1024  # noqa: E731
    base = {"model": model, "tokens": tokens, "latent": latent, "text_tokens": text, "floor_KB_per_token": kb(floor)}
    payload = {**info, "attention": comfy.ldm.modules.attention.optimized_attention.__name__, **extra,
               "block_input_bytes": inputs, "block_inputs": inputs_named, "budget_bytes": budget,
               "budget_note": "streamplan.integrations.comfy budget = activation room above what the block "
               "call holds at entry (its inputs); passed 1.15 x floor",
               "peak_note": "whole apply_model (patch embedding, text/time embeddings, head included), above what was "
               "allocated before the call (inputs, weights)",
               "rows": []}

    def emit(row):
        payload["rows"].append(row)
        print({k: v for k, v in row.items() if k != "report"}, flush=True)
        if "report" in row:
            print(row["report"], flush=True)
        write_results(name, payload)   # rewritten after every row: a run cut short keeps what it measured

    if a.weights == "dynamic":
        # the first call faults the weights into the VBAR and writes the LoRA-patched weights back there (rounded to
        # the stored dtype); it alone computes with the unrounded patch: the reference is a later call, like every step
        # after a sampling run's first
        sample_call(stock, x, cond)
    ref, stock_peak = peak_of(lambda: sample_call(stock, x, cond))
    blocks = {}
    if a.blocks:   # the block calls metered and timed; the model call timed in the same calls
        blocks = comfy_blocks.block_figures(stock, lambda pt: sample_call(pt, x, cond), dev, floor)
        stock_t, stock_block_t = blocks.pop("call_time_s"), blocks["block_time_s"]
    else:
        stock_t = time_of(lambda: sample_call(stock, x, cond))
    emit({**base, "mode": "stock", "KB_per_token": kb(stock_peak), "peak_vs_floor": stock_peak / floor,
          "time_s": stock_t, "time_ratio": 1.0, **blocks})
    modes = [(f"patch chunk_tokens={chunk}, min_tokens=0, budget=None",
              dict(budget=None, chunk_tokens=chunk, min_tokens=0), True),
             ("patch budget held to 1.15x floor, min_tokens=0", dict(budget=budget, min_tokens=0), True),
             (f"blocks only (wrapper taken out), chunk_tokens={chunk}",
              dict(budget=None, chunk_tokens=chunk, min_tokens=0), False)]
    if a.blocks:   # the criterion: fixed chunks and held, with the wrapper; and held with the donated residual
        # counted inside the 1.15x (the room above the block's entry less the residual the block overwrites)
        modes = modes[:2] + [("patch budget held to 1.15x floor counting the residual, min_tokens=0",
                              dict(budget=budget - tokens * dim * 2, min_tokens=0), True)]
        if a.modes:
            modes = [modes[BLOCK_MODES[m]] for m in a.modes.split(",")]
    if a.weights != "device":   # what "auto" reads where ComfyUI holds the weights off the device (memory.py)
        modes.append(("patch budget='auto', min_tokens=0", dict(budget="auto", min_tokens=0), True))
    for label, kw, wrapper in modes:
        try:
            patched = sc.patch(stock, **kw)
            if not wrapper:
                patched.model_options["transformer_options"]["wrappers"]["diffusion_model"].pop("streamplan")
            out, peak = peak_of(lambda: sample_call(patched, x, cond))
            diff = compare_outputs(out, ref)["output"]["rel"]
            del out
            if a.blocks:
                blocks = comfy_blocks.block_figures(patched, lambda pt: sample_call(pt, x, cond), dev, floor)
                t = blocks.pop("call_time_s")
                blocks.update(block_time_ratio=blocks["block_time_s"] / stock_block_t,
                              plans=comfy_blocks.plans_of(patched))
            else:
                t = time_of(lambda: sample_call(patched, x, cond))
            emit({**base, "mode": label, "KB_per_token": kb(peak), "peak_vs_floor": peak / floor,
                  "peak_vs_stock": peak / stock_peak if stock_peak else None, "time_s": t, "time_ratio": t / stock_t,
                  "rel_diff": diff, **blocks, "report": sc.report(patched)})
        except Exception as exc:  # noqa: BLE001 -- the row says what failed; the other mode still runs
            traceback.print_exc()
            emit({**base, "mode": label, "error": f"{type(exc).__name__}: {exc}"[:600]})
        patched = None
        if cuda:
            torch.cuda.empty_cache()
    print(write_results(name, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
