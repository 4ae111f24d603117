"""The environment registry from Python.

Every variable torch_tpu reads is declared once, in ``csrc/runtime/env.cpp``
(name, type, default, who reads it, meaning). C++ reads them through
``runtime/env.h``; Python code reads them through :func:`get`, which refuses
an undeclared name. ``python -m torch_tpu env`` lists them with the values in
force, and README's table is :func:`markdown_table` (a test holds the two
together).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

from . import _C


class Var(NamedTuple):
    name: str
    type: str
    default: str
    scope: str
    meaning: str


def variables() -> list[Var]:
    """Every declared variable, in README's order."""
    return [Var(*v) for v in _C._env_vars()]


def declared(name: str) -> Var:
    for v in variables():
        if v.name == name:
            return v
    raise KeyError(f"torch_tpu: the environment variable {name} is not declared in csrc/runtime/env.cpp")


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """The variable's value (``default`` when unset); KeyError for an undeclared name."""
    declared(name)
    return os.environ.get(name, default)


def markdown_table() -> str:
    """README's environment table."""
    rows = ["| variable | default | read by | meaning |", "| --- | --- | --- | --- |"]
    for v in variables():
        rows.append(f"| `{v.name}` | {f'`{v.default}`' if v.default else ''} | {v.scope} | {v.meaning} |")
    return "\n".join(rows)


def report() -> str:
    """Each variable with the value in force: the environment's, else the default."""
    vs = variables()
    width = max(len(v.name) for v in vs)
    lines = []
    for v in vs:
        value = os.environ.get(v.name)
        shown = repr(value) if value is not None else f"(unset; default {v.default or 'none'})"
        lines.append(f"{v.name:<{width}}  {shown:<28}  {v.scope}: {v.meaning}")
    return "\n".join(lines)
