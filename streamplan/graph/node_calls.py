"""A graph node's call as one generated function of the run's environment. Why: a chunk runs its ~100 nodes again
for every chunk, and mapping each node's arguments through ``fx.node.map_arg`` cost about as much host time as the op's
own dispatch; the generated function looks its inputs up directly (the way ``torch.fx``'s code generation does for a
whole graph). Made once per node, and again if the node's arguments are replaced."""
from __future__ import annotations

from typing import Any, Callable

from torch import fx
from torch._ops import OpOverload

_ATTR = "_streamplan_call"       # on the node: (its args, its kwargs, the function made from them)
_ATTR_OUT = "_streamplan_call_out"   # the same for its op's ``out=`` form
_ATTR_RUNS = "_streamplan_runs"      # on a run's first node: the runs compiled from it (``compile_run``)


def call_node(node: fx.Node, env: dict) -> Any:
    """``node.target`` called on its arguments' values in ``env``."""
    made = getattr(node, _ATTR, None)
    if made is None or made[0] is not node._args or made[1] is not node._kwargs:
        made = (node._args, node._kwargs, _generate(node))
        setattr(node, _ATTR, made)
    return made[2](env)


def call_node_out(node: fx.Node, env: dict, out: Any) -> Any:
    """``node``'s op in its ``out=`` form (``target.overloadpacket.out``), written into ``out``."""
    made = getattr(node, _ATTR_OUT, None)
    if made is None or made[0] is not node._args or made[1] is not node._kwargs:
        made = (node._args, node._kwargs, _generate(node, out=True))
        setattr(node, _ATTR_OUT, made)
    return made[2](env, out)


class _Source:
    """The names a generated function reads (bound into its scope) and the expressions of a node's call over them:
    a node's value from the run's environment, or from a local where the function made it."""

    def __init__(self):
        self.bound: dict[str, Any] = {}
        self.local: dict[fx.Node, str] = {}

    def bind(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.bound)}"
        self.bound[name] = value
        return name

    def op(self, target: Any) -> str:
        """An ATen overload's C++ callable itself (its ``__call__`` is one more Python frame that only forwards)."""
        return self.bind(getattr(target, "_op", target) if isinstance(target, OpOverload) else target, "op")

    def value(self, value: Any) -> str | None:
        """One argument's expression; None where it holds a container this does not rebuild."""
        if isinstance(value, fx.Node):
            return self.local[value] if value in self.local else f"env[{self.bind(value, 'n')}]"
        if isinstance(value, (list, tuple)):
            parts = [self.value(v) for v in value]
            if any(p is None for p in parts):
                return None
            if isinstance(value, list):
                return f"[{', '.join(parts)}]"
            if type(value) is not tuple:   # a named tuple or torch.Size: bound as it is where nothing inside is a node
                return self.bind(value, "c") if not any(isinstance(v, fx.Node) for v in value) else None
            return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
        if isinstance(value, (dict, slice)):
            return None if _has_node(value) else self.bind(value, "c")
        return self.bind(value, "c")

    def arguments(self, node: fx.Node, extra: tuple[str, ...] = ()) -> str | None:
        """``node``'s arguments as a call's argument list (``extra`` after them); None where one cannot be written."""
        args = [self.value(a) for a in node.args]
        kwargs = {k: self.value(v) for k, v in node.kwargs.items()}
        if any(a is None for a in args) or any(v is None for v in kwargs.values()) \
                or not all(k.isidentifier() for k in kwargs):
            return None
        return ", ".join([*args, *(f"{k}={v}" for k, v in kwargs.items()), *extra])

    def function(self, params: str, body: list[str]) -> Callable[..., Any]:
        scope: dict[str, Any] = dict(self.bound)
        exec(f"def f({params}):\n" + "\n".join(body or ["    pass"]) + "\n", scope)   # noqa: S102 - from the graph
        return scope["f"]


def _generate(node: fx.Node, out: bool = False) -> Callable[..., Any]:
    src = _Source()
    op = src.op(node.target.overloadpacket.out if out else node.target)
    arguments = src.arguments(node, ("out=into",) if out else ())
    if arguments is None or (out and "out" in node.kwargs):
        return (lambda env, into: _mapped(node, env, into)) if out else (lambda env: _mapped(node, env))
    return src.function("env, into" if out else "env", [f"    return {op}({arguments})"])


def _has_node(value: Any) -> bool:
    found = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _mapped(node: fx.Node, env: dict, into: Any = None) -> Any:
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    if into is not None:
        return node.target.overloadpacket.out(*args, **kwargs, out=into)
    return node.target(*args, **kwargs)


def compile_run(items: list[tuple[fx.Node, tuple]]) -> Callable[[dict], None] | None:
    """Consecutive nodes run as one generated function of the environment: each node's value a local until its last
    use in the run (``del`` there, where the step-by-step run would let it go), the values read last in the run from
    before it popped from the environment there, and what outlives the run written back at its end. ``items``: each
    node with the values it is the last to read (``GraphRun._frees``). None where a node's arguments hold a container
    this does not rebuild. Made once per run of the capture (kept on its first node: every call of the block, and
    every block of its class, runs the same runs)."""
    key = tuple((node, tuple(frees)) for node, frees in items)
    arguments = [(node._args, node._kwargs) for node, _ in items]   # (a node whose arguments are replaced: again)
    made = getattr(items[0][0], _ATTR_RUNS, None)
    if made is None:
        made = {}
        setattr(items[0][0], _ATTR_RUNS, made)
    found = made.get(key)
    if found is None or any(a is not b or k is not w for (a, k), (b, w) in zip(found[0], arguments)):
        found = made[key] = (arguments, _compile_run(items))
    return found[1]


def _compile_run(items: list[tuple[fx.Node, tuple]]) -> Callable[[dict], None] | None:
    src, lines = _Source(), []
    for i, (node, frees) in enumerate(items):
        op, arguments = src.op(node.target), src.arguments(node)
        if arguments is None:
            return None
        lines.append(f"    v{i} = {op}({arguments})")
        src.local[node] = f"v{i}"
        for m in frees:
            lines.append(f"    del {src.local.pop(m)}" if m in src.local else f"    env.pop({src.bind(m, 'n')}, None)")
    lines += [f"    env[{src.bind(node, 'n')}] = {var}" for node, var in src.local.items()]
    return src.function("env", lines)
