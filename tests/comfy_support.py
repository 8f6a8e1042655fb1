"""ComfyUI for the tests: finds its source (``STREAMPLAN_COMFYUI``, else ``.vendor/comfyui`` in the repo, extracted
there from ``../shared/vendor/comfyui-0.33.0-src.tar.xz`` when that tarball exists), puts it on ``sys.path`` set up
for a CPU machine (``--cpu``, PyTorch SDPA attention), and skips the calling test, saying what is missing, when it
cannot. ComfyUI is GPL-3.0: a test dependency only, never copied into the project.

torchvision: ``comfy.model_patcher`` imports ``comfy.model_base``, which imports torchvision at module level for
models unrelated to DiTs (Cosmos, Cascade, SAM 3), and PyPI's torchvision wheel does not load beside the CPU torch
build. Where ``import torchvision`` fails, a placeholder package is put in its place before ComfyUI is imported: its
modules import, and anything taken from them raises ImportError when used. Nothing the tests run uses torchvision;
``STREAMPLAN_COMFY_NO_TORCHVISION_PLACEHOLDER=1`` skips the ComfyUI tests instead.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tarfile
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TARBALL = REPO.parent / "shared" / "vendor" / "comfyui-0.33.0-src.tar.xz"
VENDORED = REPO / ".vendor" / "comfyui"
# what ComfyUI's model code and ModelPatcher import (module name -> PyPI name)
NEEDED = {"einops": "einops", "comfy_kitchen": "comfy-kitchen", "comfy_aimdo": "comfy-aimdo", "scipy": "scipy",
          "transformers": "transformers", "safetensors": "safetensors", "psutil": "psutil", "PIL": "Pillow",
          "tqdm": "tqdm", "numpy": "numpy", "yaml": "pyyaml"}

_state: dict = {}


def source_dir() -> Path | str:
    """The ComfyUI source tree, or why there is none."""
    env = os.environ.get("STREAMPLAN_COMFYUI")
    if env:
        path = Path(env)
        return path if (path / "comfy" / "model_patcher.py").is_file() else (
            f"STREAMPLAN_COMFYUI={env} holds no comfy/model_patcher.py")
    if (VENDORED / "comfy" / "model_patcher.py").is_file():
        return VENDORED
    if not TARBALL.is_file():
        return (f"no ComfyUI source: set STREAMPLAN_COMFYUI, or extract {TARBALL.name} into {VENDORED} "
                f"(not found at {TARBALL})")
    partial = VENDORED.with_name(VENDORED.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    with tarfile.open(TARBALL) as tar:
        tar.extractall(partial, filter="data")
    partial.rename(VENDORED)
    return VENDORED


class _Missing:
    """What a placeholder torchvision module hands out: fails when used, not when imported."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name}: torchvision is not installed (streamplan test placeholder)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(name, _prefix=spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Missing(f"{_prefix}.{name}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def _torchvision() -> str | None:
    if importlib.util.find_spec("torchvision") is not None and "torchvision" not in _state:
        try:
            importlib.import_module("torchvision")
            _state["torchvision"] = "real"
            return None
        except Exception as exc:  # noqa: BLE001 -- PyPI's wheel beside the CPU torch: "torchvision::nms does not exist"
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
            _state["torchvision_error"] = f"{type(exc).__name__}: {exc}"
    if _state.get("torchvision") == "real":
        return None
    if os.environ.get("STREAMPLAN_COMFY_NO_TORCHVISION_PLACEHOLDER"):
        return ("torchvision does not import (" + _state.get("torchvision_error", "not installed")
                + ") and STREAMPLAN_COMFY_NO_TORCHVISION_PLACEHOLDER is set")
    if _state.get("torchvision") != "placeholder":
        for lib in ("transformers", "diffusers"):   # they note once whether torchvision exists: before the placeholder
            try:
                importlib.import_module(f"{lib}.utils.import_utils")
            except Exception:  # noqa: BLE001 -- a library missing here simply has nothing to note
                pass
        sys.meta_path.insert(0, _TorchvisionPlaceholder())
        _state["torchvision"] = "placeholder"
    return None


def comfyui():
    """Import ComfyUI for a test (``comfy.model_patcher``, ``comfy.model_base``, the DiT model modules); skips the test
    saying what is missing. Returns the ``comfy`` package."""
    if "comfy" in _state:
        return _state["comfy"]
    if "skip" in _state:
        pytest.skip(_state["skip"])
    why = _load()
    if isinstance(why, str):
        _state["skip"] = why
        pytest.skip(why)
    _state["comfy"] = why
    return why


def _load():
    src = source_dir()
    if isinstance(src, str):
        return src
    missing = [pip for mod, pip in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        return f"ComfyUI's model code needs {', '.join(missing)} (pip install -e '.[comfy-test]')"
    why = _torchvision()
    if why:
        return why
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    try:
        from comfy.cli_args import args
        args.cpu = True
        args.use_pytorch_cross_attention = True
        import comfy.model_management  # noqa: F401
        import comfy.model_patcher  # noqa: F401
        import comfy.model_base  # noqa: F401
        import comfy.latent_formats  # noqa: F401
        import comfy.supported_models_base  # noqa: F401
        import comfy.ldm.wan.model  # noqa: F401
        import comfy.ldm.flux.model  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- whatever fails to import, the tests skip saying so
        return f"ComfyUI at {src} does not import here: {type(exc).__name__}: {exc}"
    finally:
        _drop_placeholder()
    import comfy
    return comfy


def comfy_api_io():
    """ComfyUI's V3 node API (``comfy_api.latest.io``), or a skip saying why. The tarball lacks ComfyUI's server-side
    ``protocol.py``, which ``comfy_execution.progress`` imports for one name (the binary event type of image
    previews sent to the browser, never sent here): a stand-in module supplies that name only."""
    comfyui()
    if "protocol" not in sys.modules and importlib.util.find_spec("protocol") is None:
        stand_in = types.ModuleType("protocol")
        stand_in.BinaryEventTypes = type("BinaryEventTypes", (), {"PREVIEW_IMAGE_WITH_METADATA": 4})
        sys.modules["protocol"] = stand_in
    try:
        from comfy_api.latest import io
    except Exception as exc:  # noqa: BLE001 -- the vendored tree lacks ComfyUI's server-side modules
        pytest.skip(f"comfy_api.latest does not import here: {type(exc).__name__}: {exc}")
    return io


def _drop_placeholder() -> None:
    """Once ComfyUI has imported, the placeholder leaves sys.modules and the import path (ComfyUI's modules keep the
    references they took): other libraries imported later (diffusers checks torchvision's version) never see it."""
    if _state.get("torchvision") != "placeholder":
        return
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionPlaceholder)]
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
