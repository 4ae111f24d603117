"""Runs a function once a module has been imported, without importing it.

torch_tpu adapts a few of PyTorch's own modules (Dynamo's device interfaces, Inductor's
compile entry) that cost seconds to import; most programs never load them. A finder on
``sys.meta_path`` notices their import and calls the hook right after the module's code
ran, or at once where the module is already loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable

_hooks: dict[str, list[Callable]] = {}
_lock = threading.Lock()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, attr):  # is_package, get_code, get_source, ...
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        # The spec the other finders give, its loader wrapped (this finder steps aside for it).
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_finder = _Finder()


def _run(name: str, module) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for fn in hooks:
        fn(module)


def when_imported(name: str, fn: Callable) -> None:
    """Calls ``fn(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        fn(module)
        return
    with _lock:
        _hooks.setdefault(name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
