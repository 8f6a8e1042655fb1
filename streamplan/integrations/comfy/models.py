"""ComfyUI model forwards that ``streamplan.integrations.comfy`` follows with its own streamed forward (input
projections chunk by chunk into one buffer, block inputs donated, the output head in row chunks): which classes, and the
exact source each was written against. A model of another class (Wan VACE, Camera, S2V: subclasses with their own
forward), or whose forward, output head or row helpers differ from ComfyUI 0.33.0's by a single character, keeps its
stock forward, and ``forward_problem`` says why.

Fingerprints are of the source text (``checks.source_fingerprint``), stable across Python versions."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ...recognize.checks import source_fingerprint

H3_PATH = "comfy.ldm.minimax.model.MiniMaxH3Model"
WAN_PATH = "comfy.ldm.wan.model.WanModel"
FLUX_PATH = "comfy.ldm.flux.model.Flux"
HUNYUAN_VIDEO_PATH = "comfy.ldm.hunyuan_video.model.HunyuanVideo"
LTXV_PATH = "comfy.ldm.lightricks.model.LTXVModel"
LTXAV_PATH = "comfy.ldm.lightricks.av_model.LTXAVModel"
CHROMA_PATH = "comfy.ldm.chroma.model.Chroma"

# class path -> {what: fingerprint}, ComfyUI 0.33.0. ``what`` names a function the streamed forward follows (the model
# forward and the functions whose row layout or per-row math it reproduces chunk by chunk, or that it calls on row
# chunks): "Class.method" or "function" as the model's module sees them, or "package.module:Class.method"
KNOWN: dict[str, dict[str, str]] = {
    H3_PATH: {"MiniMaxH3Model.forward": "8d150257b0a71ea5", "MiniMaxH3Model._forward": "3679bddb6af97a15",
              "FinalLayer.forward": "7b83b67fbc702bc8", "patchify_video": "124c9f0151cce8ca",
              "pack_audio": "8db1c3b670175ce7"},
    WAN_PATH: {"WanModel.forward": "aaf45014828962a4", "WanModel._forward": "cecb39002f09da25",
               "WanModel.forward_orig": "249cd41797b22e63", "Head.forward": "756047ae4c35fd00",
               "repeat_e": "480e9e42e517bf5c", "WanModel.unpatchify": "a6843ac57815fd3f"},
    # the final layer is called on row chunks: it and its modulation helper must stay row-local
    FLUX_PATH: {"Flux.forward": "6416ccb89aa32516", "Flux._forward": "327f03dd13b25d6e",
                "Flux.forward_orig": "ff2fa9c3944a19d7", "LastLayer.forward": "bc898fe6b02c5cf0",
                "comfy.ldm.flux.layers:apply_mod": "87f491e4c84dc95f"},
    HUNYUAN_VIDEO_PATH: {"HunyuanVideo.forward": "ea0c5a74c0a8ef0d", "HunyuanVideo._forward": "3385f0debe956fc8",
                         "HunyuanVideo.forward_orig": "90e86054134deef8", "LastLayer.forward": "bc898fe6b02c5cf0",
                         "comfy.ldm.flux.layers:apply_mod": "87f491e4c84dc95f",
                         "comfy.ldm.modules.diffusionmodules.mmdit:PatchEmbed.forward": "d6aee2a24259e371"},
    CHROMA_PATH: {"Chroma.forward": "5007d16575e3e9d4", "Chroma._forward": "b6821ebfe49e5f94",
                  "Chroma.forward_orig": "fb05dc2ddbd95dcd",
                  "comfy.ldm.chroma.layers:LastLayer.forward": "a8161c71d4789d8a"},
    LTXV_PATH: {"LTXVModel.forward": "818dbbc43fdbd690", "LTXVModel._forward": "1cd3eae65657c393",
                "LTXVModel._process_transformer_blocks": "4761ee12958818ee",
                "LTXVModel._process_output": "0795d1667bbc4784"},
    # LTX-2: the timestep helper is handed the distinct video timesteps, the rotary helpers are called on row chunks,
    # and the blocks read plain tensors where stock hands them CompressedTimestep records
    LTXAV_PATH: {"LTXAVModel.forward": "00b3597ab871285d", "LTXAVModel._forward": "1cd3eae65657c393",
                 "LTXAVModel._prepare_timestep": "fe7f5370dd87255f",
                 "LTXAVModel._prepare_positional_embeddings": "6864527d7c9af80e",
                 "LTXAVModel._process_transformer_blocks": "2895669cb2a3ccd0",
                 "LTXAVModel._process_output": "8675f4b4a21e4351", "LTXVModel._process_output": "0795d1667bbc4784",
                 "CompressedTimestep.expand_for_computation": "7cfd6f5d4f922c98",
                 "BasicAVTransformerBlock.get_ada_values": "20bf3b6252d00fa0",
                 "comfy.ldm.lightricks.model:LTXBaseModel._prepare_positional_embeddings": "67601538fccc9583",
                 "comfy.ldm.lightricks.model:LTXBaseModel._precompute_freqs_cis": "5940284f1ff0b6b9",
                 "comfy.ldm.lightricks.model:generate_freqs": "2a703132c71bbc94",
                 "comfy.ldm.lightricks.model:freqs_cis_matrix": "c4fcdaef6068ccbc"},
}
_SEEN: dict[Any, str | None] = {}


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _function(cls: type, what: str) -> Callable | None:
    """The function ``what`` names, looked up where the model's forward finds it (its class, its module's globals),
    or in the module a "module:" prefix names."""
    module, _, what = what.rpartition(":")
    owner, _, attr = what.rpartition(".")
    if module:
        import importlib
        try:
            glob = vars(importlib.import_module(module))
        except ImportError:
            return None
    else:
        glob = getattr(cls.forward, "__globals__", {})
    if not owner:
        return glob.get(attr)
    holder = cls if owner == cls.__name__ else glob.get(owner)
    return getattr(holder, attr, None) if holder is not None else None


def forward_problem(model: nn.Module) -> str | None:
    """Why the streamed forward does not follow this model (its class, or code that is not what it was written
    against), or None."""
    cls = type(model)
    path = class_path(cls)
    known = KNOWN.get(path)
    if known is None:
        bases = [class_path(b) for b in cls.__mro__[1:] if class_path(b) in KNOWN]
        if bases:
            return (f"{cls.__name__} is a subclass of {bases[0].rsplit('.', 1)[1]} with its own forward: streamplan "
                    "follows the base class only")
        return f"{cls.__name__} has no streamed model forward in streamplan (its blocks still stream)"
    funcs = tuple(_function(cls, w) for w in known)
    key = (cls, funcs)
    if key not in _SEEN:
        odd = [w for w, f in zip(known, funcs) if f is None or source_fingerprint(f) != known[w]]
        _SEEN[key] = (f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not the code streamplan follows "
                      "(ComfyUI 0.33.0's): unknown forward") if odd else None
    return _SEEN[key]
