"""The package is laid out by stage (docs/design.md, "Layout"): specs -> graph -> plan -> execute, with recognition
and the host libraries above them and the public API and tools on top. These tests read every module's imports,
deferred ones inside functions included, and fail on an import that points up the stack or closes a cycle."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "streamplan"

# a module may import its own layer and any layer ranked below it
RANK = {
    "specs": 0, "registries": 1, "meter": 1,
    "plan": 2, "attention": 2,
    "graph": 3,
    "execute": 4,
    "recognize": 5,
    "integrations": 6,
    "options": 7, "report": 7, "timeline": 7,
    "api": 8,
    "verify": 9,
    "tools": 10, "__main__": 11,
}
# host adapters: integrations that sit on the public API (ComfyUI's node pack streams through ``BlockStreamer``)
ABOVE_API = {"streamplan.integrations.comfy.patch": 8.5, "streamplan.integrations.comfy.nodes": 8.5}


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every streamplan module ``module`` imports, at the top or inside a function."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "streamplan":
                continue
            for alias in node.names:   # ``from pkg import submodule`` imports the submodule
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "streamplan"}
    return {t for t in found if t != module}


EDGES = {m: _imports(m, p) for m, p in MODULES.items()}


def _rank(module: str) -> float:
    if module in ABOVE_API:
        return ABOVE_API[module]
    parts = module.split(".")
    return RANK[parts[1]] if len(parts) > 1 else max(RANK.values()) + 1   # the package root: the lazy front door


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if "." in m and m.split(".")[1] not in RANK]


def test_no_import_points_up_the_stack():
    bad = []
    for module, targets in EDGES.items():
        for target in targets:
            same_layer = module.split(".")[:2] == target.split(".")[:2]
            if not same_layer and _rank(target) >= _rank(module) and not (target == "streamplan" and
                                                                             module.startswith("streamplan.tools")):
                bad.append(f"{module} imports {target}")
    assert not bad, "imports against the data flow:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    """Tarjan's strongly connected components over every import, deferred ones included: none larger than one."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in EDGES.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_is_imported_across_modules():
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("streamplan")):
                bad += [f"{module}: {a.name}" for a in node.names if a.name.startswith("_")
                        and a.name != "__version__"]
    assert not bad, "private names imported from another module:\n" + "\n".join(sorted(bad))


def test_no_function_is_longer_than_about_a_hundred_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 110:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "functions to split into named stages:\n" + "\n".join(long)
