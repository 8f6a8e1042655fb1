"""examples/*.json against ComfyUI 0.33.0 itself (tests/comfy_support.py): ComfyUI loads the pack the two ways the
docs say (a custom_nodes folder holding this repository, or one file importing the pip-installed package); every
example validates against the node classes' own definitions, the model files it names listed where examples/README.md
says to put them; and each example's Stream Blocks -> sampler -> Stream Report -> Preview as Text part runs on a tiny
random-weight Wan through the node classes' own functions, ordered by ComfyUI's own TopologicalSort, the report
reaching PreviewAny's output and ui. The server and executor are not in the vendored tarball (shared/vendor/README.md):
nodes run as the executor would call them, loaders and text encoders (files, real sizes) replaced by tiny values."""
from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import comfy_support
from comfy_support import comfy_api_io, comfyui

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.json"))
BLOCKS, REPORT, PREVIEW = "StreamplanStreamBlocks", "StreamplanStreamReport", "PreviewAny"
# what ComfyUI's nodes.py and comfy_extras import that cannot be imported here: no PyPI wheel of torchvision or
# torchaudio loads beside the CPU torch build, and the tarball leaves out three tokenizer modules. A placeholder stands
# in for each while the node modules import (no test runs code that uses them) and leaves sys.modules after.
UNLOADABLE = ("torchvision", "torchaudio", "comfy.ldm.cosmos.cosmos_tokenizer", "comfy.text_encoders.spiece_tokenizer",
              "comfy.text_encoders.bpe_tokenizer")
_state: dict = {}


class _Placeholders(comfy_support._TorchvisionPlaceholder):
    """comfy_support's torchvision placeholder, for each of ``names``."""

    def __init__(self, names: list[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 -- a wheel that does not load beside this torch counts as absent
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
        return False


def _protocol_spec() -> None:
    """comfy_support's stand-in ``protocol`` module has no ``__spec__``, on which ``importlib.util.find_spec`` (its own
    check when comfy_api_io is called again, by tests/test_comfy.py) raises: the stand-in gets one."""
    stand_in = sys.modules.get("protocol")
    if stand_in is not None and stand_in.__spec__ is None:
        stand_in.__spec__ = importlib.machinery.ModuleSpec("protocol", None)


def comfy_nodes():
    """ComfyUI's ``nodes`` module with comfy_extras loaded (``NODE_CLASS_MAPPINGS``), or a skip saying why."""
    if "nodes" in _state:
        return _state["nodes"]
    _protocol_spec()
    comfy_api_io()
    _protocol_spec()
    if not _imports("torchsde"):
        pytest.skip("ComfyUI's samplers import torchsde (its requirements.txt): pip install torchsde")
    absent = [n for n in UNLOADABLE if not _imports(n)]
    finder = _Placeholders(absent)
    sys.meta_path.insert(0, finder)
    try:
        import nodes
        failed = asyncio.run(nodes.init_builtin_extra_nodes())
    finally:
        sys.meta_path.remove(finder)
        for mod in [m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in absent)]:
            del sys.modules[mod]
    _state["nodes"], _state["failed"] = nodes, failed
    return nodes


def _load_pack(nodes, path: Path) -> None:
    assert asyncio.run(nodes.load_custom_node(str(path), module_parent="custom_nodes")), path
    assert {BLOCKS, REPORT} <= set(nodes.NODE_CLASS_MAPPINGS), path


def test_comfyui_loads_the_pack_both_ways(tmp_path):
    """A clone in custom_nodes (the repository's __init__.py), and the pip route: one file in custom_nodes that
    imports the installed package's entry point; each registers both nodes with their display names."""
    nodes = comfy_nodes()
    for node_id in (BLOCKS, REPORT):
        nodes.NODE_CLASS_MAPPINGS.pop(node_id, None)
    entry = tmp_path / "streamplan_nodes.py"
    entry.write_text("from streamplan.integrations.comfy.nodes import comfy_entrypoint  # noqa: F401\n")
    _load_pack(nodes, entry)
    for node_id in (BLOCKS, REPORT):
        nodes.NODE_CLASS_MAPPINGS.pop(node_id)
    _load_pack(nodes, REPO)
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS[REPORT] == "Stream Report (streamplan)"
    schema = nodes.NODE_CLASS_MAPPINGS[REPORT].GET_SCHEMA()
    # index 0 stays the samples (links made to it keep working); the text is index 1
    assert [o.io_type for o in schema.outputs] == ["LATENT", "STRING"]


def _mappings():
    nodes = comfy_nodes()
    if REPORT not in nodes.NODE_CLASS_MAPPINGS:
        _load_pack(nodes, REPO)
    return nodes.NODE_CLASS_MAPPINGS


def _model_files() -> dict[str, list[tuple[str, str]]]:
    """examples/README.md's tables: per example file, (ComfyUI models folder, file name)."""
    files: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in (REPO / "examples" / "README.md").read_text().splitlines():
        heading = re.match(r"^#+ .*`([\w.]+\.json)`", line)
        if heading:
            current = files.setdefault(heading.group(1), [])
        row = re.match(r"^\| `([^`]+)` \| `models/([^`/]+)/` \|", line)
        if row and current is not None:
            current.append((row.group(2), row.group(1)))
    return files


def _literal_problem(kind, extra: dict, value) -> str | None:
    options = kind if isinstance(kind, list) else extra.get("options") if kind == "COMBO" else None
    if options is not None:
        keys = [o["key"] if isinstance(o, dict) else o for o in options]
        return None if value in keys else f"{value!r} is not among {keys[:8]}"
    if kind == "COMFY_DYNAMICCOMBO_V3":
        keys = [o["key"] for o in extra["options"]]
        return None if value in keys else f"{value!r} is not among {keys}"
    python = {"INT": (int,), "FLOAT": (int, float), "BOOLEAN": (bool,), "STRING": (str,)}
    allowed = [t for k in str(kind).split(",") for t in python.get(k, ())]
    if not allowed:
        return f"a literal for a {kind} input"
    if not isinstance(value, tuple(allowed)) or (bool not in allowed and isinstance(value, bool)):
        return f"{value!r} is not {kind}"
    if "min" in extra and value < extra["min"] or "max" in extra and value > extra["max"]:
        return f"{value!r} is outside [{extra.get('min')}, {extra.get('max')}]"
    return None


def _problems(graph: dict, mappings: dict) -> list[str]:
    """What ComfyUI's prompt validation would refuse: unknown classes, missing or unknown inputs, links to missing
    nodes or outputs or of the wrong type (``comfy_execution.validation.validate_node_input``), literals out of range
    or not among a combo's options."""
    from comfy_api.latest._io import get_finalized_class_inputs
    from comfy_execution.validation import validate_node_input

    out = []
    for nid, node in graph.items():
        cls = mappings.get(node["class_type"])
        if cls is None:
            out.append(f"{nid}: no node class {node['class_type']!r}")
            continue
        declared = cls.INPUT_TYPES()
        if hasattr(cls, "GET_SCHEMA"):   # a V3 node: dynamic inputs expand from the values given
            declared = get_finalized_class_inputs(declared, node["inputs"])[0]
        required, optional = declared.get("required", {}), declared.get("optional", {})
        out += [f"{nid} {node['class_type']}: required input {name!r} missing" for name in required
                if name not in node["inputs"]]
        for name, value in node["inputs"].items():
            spec = required.get(name) or optional.get(name)
            if spec is None:
                out.append(f"{nid} {node['class_type']}: no input {name!r}")
                continue
            kind, extra = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(value, list):
                src = graph.get(value[0])
                returns = list(mappings[src["class_type"]].RETURN_TYPES) if src and src["class_type"] in mappings \
                    else []
                if not isinstance(value[1], int) or not 0 <= value[1] < len(returns):
                    out.append(f"{nid}.{name}: link {value} to no output")
                elif not validate_node_input(returns[value[1]], kind):
                    out.append(f"{nid}.{name}: link {value} gives {returns[value[1]]}, the input takes {kind}")
                continue
            why = _literal_problem(kind, extra, value)
            if why:
                out.append(f"{nid} {node['class_type']}.{name}: {why}")
    return out


def _one(graph: dict, kind: str) -> str:
    found = [nid for nid, n in graph.items() if n["class_type"] == kind]
    assert len(found) == 1, (kind, found)
    return found[0]


def _ancestors(graph: dict, nid: str) -> set[str]:
    seen, todo = set(), [nid]
    while todo:
        for value in graph[todo.pop()]["inputs"].values():
            if isinstance(value, list) and value[0] not in seen:
                seen.add(value[0])
                todo.append(value[0])
    return seen


def test_examples_validate_against_comfyui(tmp_path, monkeypatch):
    """Each example as ComfyUI's /prompt would check it, with the files its README table names placed in those
    folders; and its wiring: the sampler takes the streamed MODEL, the report its output, PreviewAny the report."""
    mappings = _mappings()
    import folder_paths
    assert EXAMPLES
    tables = _model_files()
    assert set(tables) == {p.name for p in EXAMPLES}, "examples/README.md has one table per example"
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    for path in EXAMPLES:
        graph = json.loads(path.read_text())
        root = tmp_path / path.stem
        folder_paths.filename_list_cache.clear()   # each example sees its own files only
        for folder in {f for f, _ in tables[path.name]}:
            (root / folder).mkdir(parents=True)
            monkeypatch.setitem(folder_paths.folder_names_and_paths, folder,
                                ([str(root / folder)], folder_paths.supported_pt_extensions))
        for folder, name in tables[path.name]:
            (root / folder / name).touch()
        named = {v for n in graph.values() for v in n["inputs"].values() if str(v).endswith(".safetensors")}
        assert named == {name for _, name in tables[path.name]}, path.name
        assert _problems(graph, mappings) == [], (path.name, _state["failed"])
        blocks, report, preview = (_one(graph, k) for k in (BLOCKS, REPORT, PREVIEW))
        returns = list(mappings[REPORT].RETURN_TYPES)
        assert graph[preview]["inputs"]["source"] == [report, returns.index("STRING")], path.name
        assert graph[report]["inputs"]["model"] == [blocks, 0], path.name
        upstream = _ancestors(graph, blocks) | {blocks}
        for nid, node in graph.items():   # every MODEL taken after Stream Blocks is its output
            declared = mappings[node["class_type"]].INPUT_TYPES().get("required", {})
            for name, value in node["inputs"].items():
                if nid not in upstream and name in declared and declared[name][0] == "MODEL":
                    assert value == [blocks, 0], (path.name, nid, name)
        sampler = graph[report]["inputs"]["samples"][0]
        assert blocks in _ancestors(graph, sampler), path.name


# --- the report chain run on a tiny model ----------------------------------------------------------------------------

# outputs of these types come from files or real-size latents in the examples: the run hands tiny values instead
SUBSTITUTED = ("MODEL", "CONDITIONING", "LATENT")
TINY = {BLOCKS: {"budget": "none", "chunk_tokens": 64, "min_tokens": 0}}   # 768 rows: stream, in 64-row chunks


def _tiny_wan(comfy):
    """A 2-block random-weight Wan in a real BaseModel and ModelPatcher (as tests/test_comfy.py builds them), with a
    4-channel latent format so ComfyUI's samplers take its 4-channel latents."""
    class Latent(comfy.latent_formats.LatentFormat):
        latent_channels, latent_dimensions = 4, 3

    class Config(comfy.supported_models_base.BASE):
        unet_config, unet_extra_config, sampling_settings = {}, {}, {"shift": 1.0}
        supported_inference_dtypes = [torch.float32]
        latent_format = Latent

    unet = {"image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2,
            "in_dim": 4, "out_dim": 4, "text_dim": 32, "freq_dim": 32, "eps": 1e-6, "patch_size": (1, 2, 2)}
    base = comfy.model_base.WAN21(Config(unet))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in base.parameters():   # comfy.ops layers skip init
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05))
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def _call(cls, inputs: dict) -> tuple[tuple, dict | None]:
    """(result, ui) of one node, called as ComfyUI's executor calls it: ``getattr(instance, FUNCTION)(**inputs)``."""
    returned = getattr(cls(), cls.FUNCTION)(**inputs)
    if inspect.iscoroutine(returned):
        returned = asyncio.run(returned)
    if isinstance(returned, dict):
        return tuple(returned.get("result", ())), returned.get("ui")
    if hasattr(returned, "result"):   # a V3 NodeOutput
        ui = returned.ui.as_dict() if hasattr(returned.ui, "as_dict") else returned.ui
        return tuple(returned.result or ()), ui
    return tuple(returned), None


def _run_report_chain(graph: dict, mappings: dict, tiny: dict) -> dict[str, tuple[tuple, dict | None]]:
    """Runs what Preview as Text depends on, in ComfyUI's TopologicalSort order: an output of a SUBSTITUTED type that
    does not come from Stream Blocks or the sampler feeding the report is the tiny value for that type."""
    from comfy_execution.graph import DynamicPrompt, TopologicalSort

    report = _one(graph, REPORT)
    ran = {_one(graph, BLOCKS), graph[report]["inputs"]["samples"][0], report, _one(graph, PREVIEW)}
    replaced = {nid for nid, n in graph.items() if nid not in ran
                and any(t in SUBSTITUTED for t in mappings[n["class_type"]].RETURN_TYPES)}
    pruned = {nid: {**n, "inputs": {}} if nid in replaced else n for nid, n in graph.items()}   # their inputs unused
    order = TopologicalSort(DynamicPrompt(pruned))
    order.add_node(_one(graph, PREVIEW))
    results: dict[str, tuple[tuple, dict | None]] = {}
    while not order.is_empty():
        nid = order.get_ready_nodes()[0]
        order.pop_node(nid)
        node, cls = graph[nid], mappings[graph[nid]["class_type"]]
        if nid in replaced:
            results[nid] = (tuple(tiny.get(t) for t in cls.RETURN_TYPES), None)
            continue
        inputs = {k: results[v[0]][0][v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
        inputs.update(TINY.get(node["class_type"], {}))
        if "steps" in inputs:
            inputs["steps"] = 2
        results[nid] = _call(cls, inputs)
    return results


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_report_reaches_preview_as_text(example, monkeypatch):
    """The example's own wiring, run: the sampler's model calls stream through Stream Blocks, Stream Report passes
    the samples on and hands its text to PreviewAny, whose output and ui are that text, tier lines included."""
    mappings = _mappings()
    comfy = comfyui()
    import streamplan.graph  # noqa: F401 -- captures are cached per block class for the process: start empty
    monkeypatch.setattr(sys.modules["streamplan.graph"], "_CACHE", {})
    g = torch.Generator().manual_seed(1)
    tiny = {"MODEL": _tiny_wan(comfy), "CONDITIONING": [[torch.randn(1, 7, 32, generator=g), {}]],
            "LATENT": {"samples": torch.randn(1, 4, 3, 32, 32, generator=g)}}   # 3 x 16 x 16 = 768 rows
    graph = json.loads((REPO / "examples" / example).read_text())
    results = _run_report_chain(graph, mappings, tiny)
    report, preview = _one(graph, REPORT), _one(graph, PREVIEW)
    sampler = graph[report]["inputs"]["samples"]
    (samples, text), _ = results[report]
    assert samples is results[sampler[0]][0][sampler[1]] and samples["samples"].shape == (1, 4, 3, 32, 32)
    shown, ui = results[preview]
    assert shown == (text,) and ui == {"text": (text,)}
    assert "report for WanModel: 2 block(s) patched" in text and "chunk_tokens 64, min_tokens 0" in text, text
    for block in ("double_block.0", "double_block.1"):
        line = re.search(rf"^  {block}: (.*)$", text, re.M)
        assert line and re.match(r"[1-9]\d* call\(s\) through the streamer", line.group(1)), text
    tiers = re.findall(r"^ +tiers: (.+)$", text, re.M)   # a streamed tier (L0 is the stock forward), 64-row chunks
    assert len(tiers) == 2 and all(re.match(r"L[1-9]\d* ", t) for t in tiers), text
    assert len(re.findall(r" L[1-9]\d* +64 ", text)) == 2, text
    assert "stock" not in text.split("model forward")[1].splitlines()[0], text
