"""The environment registry from Python.

Every variable torch_tpu reads, of any prefix, is declared once in
``csrc/runtime/env.cpp`` (name, type, default, who reads it, meaning); other
programs' variables that the package reads (torchrun's, vLLM's, the system's)
too, with a scope that says whose they are. C++ reads them through
``runtime/env.h``; Python code reads them through :func:`get`, which refuses an
undeclared name (tests/python/test_guard_docs_env.py refuses a read that goes
around it). ``python -m torch_tpu env`` lists them with the values in force,
and ``docs/environment.md`` is :func:`markdown_page`
(``python -m torch_tpu env --markdown > docs/environment.md``; a test holds the
two together).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

from . import _C

REGENERATE = "python -m torch_tpu env --markdown > docs/environment.md"


class Var(NamedTuple):
    name: str
    type: str
    default: str
    scope: str
    meaning: str


@functools.lru_cache(maxsize=None)
def _declared() -> dict:
    return {v[0]: Var(*v) for v in _C._env_vars()}


def variables() -> list[Var]:
    """Every declared variable, in the registry's order."""
    return list(_declared().values())


def declared(name: str) -> Var:
    try:
        return _declared()[name]
    except KeyError:
        raise KeyError(f"torch_tpu: the environment variable {name} is not declared in "
                       "csrc/runtime/env.cpp") from None


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """The variable's value (``default`` when unset); KeyError for an undeclared name."""
    declared(name)
    return os.environ.get(name, default)


def markdown_table() -> str:
    """The registry as a Markdown table."""
    rows = ["| variable | type | default | read by | meaning |", "| --- | --- | --- | --- | --- |"]
    for v in variables():
        rows.append(f"| `{v.name}` | {v.type} | {f'`{v.default}`' if v.default else ''} | {v.scope} | {v.meaning} |")
    return "\n".join(rows)


def markdown_page() -> str:
    """docs/environment.md: the registry's table with what it is and how to use it."""
    return f"""# Environment variables

<!-- Generated from the registry (csrc/runtime/env.cpp) by `{REGENERATE}`;
edit the registry, then regenerate. tests/python/test_env.py holds the two together. -->

Every environment variable torch_tpu reads, in C++ and in Python, is declared once in
`csrc/runtime/env.cpp` (name, type, default, who reads it, meaning) and read through that
registry: `runtime/env.h` in C++, `torch_tpu._env` in Python. Variables of other programs that
torch_tpu reads (torchrun's, vLLM's, the system's) are declared too; "read by" says whose they
are. A variable set to something it cannot read (`TORCH_TPU_CPU_DEVICES=two`) is an error at
start that names it.

    python -m torch_tpu env              # each variable with the value in force
    python -m torch_tpu env --markdown   # this page

Defaults are what an unset variable means; an empty default means off, none, or the behaviour
the meaning describes.

{markdown_table()}
"""


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
