"""Cache objects a block only reads, taken by the capture as their tensors.

A block called with a cache object (a per-layer K/V cache a pipeline hands every denoising step) cannot be exported:
export takes tensors and plain values. Where the library's recognizer file declares the cache class
(``registries.register_read_cache``), the call's cache is replaced by a ``CacheView``: a pytree node of its tensor
attributes, its plain attributes (a mode string) kept as the node's context so that each mode captures on its own.
Inside the trace the block gets a read-only copy of the cache rebuilt from those tensors; a block that writes it (a
"store" step) fails the capture with ``CacheWritten`` and keeps its stock call, named. The view is streamplan's own
type, so no library class is registered with pytree, and other code that flattens the user's caches is unaffected.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..registries import READ_CACHES

_PLAIN = (int, float, bool, str, type(None))


class CacheWritten(RuntimeError):
    """The traced block wrote the cache it was given: the call fills a cache, and runs stock."""


class _ReadList(tuple):
    """A cache's list of tensors that may be read, not changed."""

    owner = "cache"

    def _refuse(self, *args, **kwargs):
        raise CacheWritten(f"the block changes a list of tensors in its {self.owner} argument (a cache being filled)")

    append = extend = insert = pop = remove = clear = __setitem__ = __delitem__ = _refuse


class CacheView:
    """Marks the read-only copies: each declared cache class gets one subclass of it and of this (``_view_class``),
    registered with pytree as its tensor attributes (children) and the rest as context (names, plain values). A
    round trip through pytree gives a view again, so export's own maps over the inputs keep it one."""

    _names: tuple[str, ...] = ()
    _plain: tuple[tuple[str, Any], ...] = ()


_VIEWS: dict[type, type] = {}


def _view_class(cls: type) -> type:
    if cls not in _VIEWS:
        def refuse(self, name, value=None):
            raise CacheWritten(f"the block sets {cls.__name__}.{name} (a cache being filled)")
        view = type(cls.__name__, (cls, CacheView), {"__setattr__": refuse, "__delattr__": refuse,
                                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        pytree.register_pytree_node(view, _flatten, _unflatten(view),
                                    serialized_type_name=f"streamplan.CacheView.{cls.__module__}.{cls.__qualname__}",
                                    flatten_with_keys_fn=_flatten_with_keys)
        _VIEWS[cls] = view
    return _VIEWS[cls]


def view_children(view: CacheView) -> list:
    """A view's children in pytree order (a tensor, None or a tuple of them each)."""
    return _values(view)


def _values(view: CacheView) -> list:
    values = (object.__getattribute__(view, n) for n in view._names)
    return [tuple(v) if isinstance(v, _ReadList) else v for v in values]


def _flatten(view: CacheView) -> tuple[list, tuple]:
    return _values(view), (view._names, view._plain)


def _flatten_with_keys(view: CacheView) -> tuple[list, tuple]:
    return [(pytree.GetAttrKey(n), v) for n, v in zip(view._names, _values(view))], (view._names, view._plain)


def _unflatten(view_cls: type):
    def build(values: Any, context: tuple) -> CacheView:
        names, plain = context
        return _build(view_cls, names, plain, list(values))
    return build


def _build(view_cls: type, names: tuple, plain: tuple, values: list) -> CacheView:
    obj = object.__new__(view_cls)
    object.__setattr__(obj, "_names", names)
    object.__setattr__(obj, "_plain", plain)
    for name, value in (*plain, *zip(names, values)):
        if isinstance(value, (list, tuple)):
            value = _ReadList(value)
            value.owner = f"{view_cls.__name__}.{name}"
        object.__setattr__(obj, name, value)
    return obj


def _tensor_value(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(v is None or isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def view_of(cache: Any) -> CacheView | str:
    """The cache's read-only view, or why it cannot be one (an attribute that is neither tensors nor plain)."""
    names, values, plain = [], [], []
    for name, value in sorted(vars(cache).items()):
        if _tensor_value(value):
            names.append(name)
            values.append(tuple(value) if isinstance(value, (list, tuple)) else value)
        elif isinstance(value, _PLAIN):
            plain.append((name, value))
        else:
            return (f"its {type(cache).__name__} argument holds {type(value).__name__} in {name!r} (a read cache "
                    "may hold tensors, lists of them and plain values)")
    return _build(_view_class(type(cache)), tuple(names), tuple(plain), values)


def _is_read_cache(value: Any) -> bool:
    cls = type(value)
    return not isinstance(value, CacheView) and f"{cls.__module__}:{cls.__qualname__}" in READ_CACHES


def viewed(args: tuple, kwargs: dict) -> tuple[tuple, dict] | str:
    """The call with every declared cache object replaced by its view (the same objects when it has none), or why a
    cache cannot be viewed."""
    if not READ_CACHES:
        return args, kwargs
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(_is_read_cache(leaf) for leaf in leaves):
        return args, kwargs
    problems: list[str] = []

    def view(leaf: Any) -> Any:
        if not _is_read_cache(leaf):
            return leaf
        found = view_of(leaf)
        if isinstance(found, str):
            problems.append(found)
            return leaf
        return found

    out = pytree.tree_map(view, (args, kwargs))
    return problems[0] if problems else out
