"""Data flows one way: capture/recognize -> specs -> planner -> executors (DESIGN.md section 2). This test reads every
module's imports and fails on an import that points back up the stack. Known back-edges that remain are listed by
name, so that a new one fails here and an old one, once removed, must be taken off the list."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "streamplan"

# what each layer may import from streamplan (its own package always allowed)
ALLOWED = {
    "ir": set(),
    "weights": set(),
    "budget": set(),
    "consumers": set(),
    "meter": set(),
    "planner": {"ir", "weights", "budget"},
    "executors": {"ir", "planner", "consumers"},      # plans are data handed to executors
    # hooks: the library-agnostic hook-chain registry, which library files fill in (as they fill ir's registries)
    "recognize": {"ir", "weights", "consumers", "hooks"},
    "capture": {"ir"},
    "stock_watch": set(),
}
# modules whose job is to run code (the captured graph's executor) sit with the executors
EXECUTOR_MODULES = {"streamplan.capture.execute": {"executors", "ir", "planner"},
                    "streamplan.capture.memory": {"ir"}}
# remaining back-edges: family files that keep a model forward or block binder which calls into executors
KNOWN_BACK_EDGES = {
    ("streamplan.recognize.diffusers_wan", "streamplan.executors"),
    ("streamplan.recognize.diffusers_h3", "streamplan.executors"),
    ("streamplan.recognize.transformers_decoders", "streamplan.executors"),
}


def _imports(path: pathlib.Path) -> set[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = parts if path.name == "__init__.py" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module and node.module.startswith("streamplan"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("streamplan")}
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_points_back_up_the_stack():
    bad, used = [], set()
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        layer = _layer(module)
        allowed = EXECUTOR_MODULES.get(module, ALLOWED.get(layer))
        if allowed is None:       # api, cli, demo, bench, verify, catalogue: the top, free to import
            continue
        for target in _imports(path):
            t_layer = _layer(target)
            if t_layer in ("", layer) or t_layer in allowed:
                continue
            edge = (module, ".".join(target.split(".")[:2]))
            if edge in KNOWN_BACK_EDGES:
                used.add(edge)
                continue
            bad.append(f"{module} imports {target}")
    assert not bad, "imports against the data flow:\n" + "\n".join(sorted(bad))
    assert used == KNOWN_BACK_EDGES, f"back-edges removed, take them off the list: {KNOWN_BACK_EDGES - used}"
