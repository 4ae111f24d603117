#!/usr/bin/env python
"""docs/compatibility.md: every call other libraries make into ``torch_tpu`` / ``torch.tpu`` /
device ``tpu`` / ``tpu_dist`` / ``TPU_*``, where it is, and whether torch_tpu answers it.

Each row (tools/compatibility_rows.toml) names the caller's file (inside its installed package) and a line of code that
identifies the call; the tool finds the line's number in the version installed here, and runs
the row's check against torch_tpu: a Python expression that is true when the call works as the
caller expects. A caller that is not installed here (TorchRec, Helion, Google's vLLM plugin)
keeps the place it was read at, and its check still runs against torch_tpu's side.

    python tools/compatibility.py > docs/compatibility.md      # regenerate
    python tools/compatibility.py --check                      # exit 1 if a check fails

tests/python/test_compatibility.py runs every check and compares the page with this output.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import traceback
from typing import NamedTuple, Optional


class Row(NamedTuple):
    library: str  # its distribution name
    path: str  # the caller's file, relative to site-packages (or "repo@commit:path" when not installed)
    line: str  # a line of the caller's code that identifies the call
    call: str  # what it calls
    expects: str  # what the caller expects
    answer: str  # what torch_tpu does
    check: str  # a Python expression, true when it works (torch, torch_tpu, dist, importlib in scope)
    reason: Optional[str] = None  # where the check is expected to fail: why


ROWS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compatibility_rows.toml")


def load_rows() -> list:
    import tomllib

    with open(ROWS_FILE, "rb") as f:
        return [Row(**r) for r in tomllib.load(f)["row"]]


ROWS = load_rows()


# --- helpers the checks use


def _call(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)()


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _env_vars() -> set:
    from torch_tpu import _env

    return {v.name for v in _env.variables()}


def _patched(module: str, name: str) -> bool:
    return getattr(getattr(importlib.import_module(module), name), "_torch_tpu", False)


def _inductor_redirected() -> bool:
    import torch._inductor.compile_fx as cf

    return getattr(cf.compile_fx, "_torch_tpu", False)


def _accelerate_distributed() -> bool:
    from accelerate.state import PartialState

    return getattr(PartialState._prepare_backend, "_torch_tpu", False)


def _accelerate_default_device() -> bool:
    from accelerate.state import PartialState

    return getattr(PartialState.default_device.fget, "_torch_tpu", False)


def _titan_peak(kind: str) -> float:
    from torchtitan.tools.utils import get_peak_flops

    from torch_tpu.device import _TPU_NAMES

    return get_peak_flops(_TPU_NAMES[kind])


def _vllm_entry_point() -> Optional[str]:
    for e in importlib.metadata.entry_points(group="vllm.platform_plugins"):
        if e.value == "torch_tpu.vllm:register":
            return e.name
    return None


def _site_packages() -> list:
    import site

    return [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]


def _version(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def locate(row: Row) -> str:
    """"file:line" in the installed package, or the place it was read at."""
    if ":" in row.path or " " in row.path or not _version(row.library):
        return row.path
    for base in _site_packages():
        full = os.path.join(base, row.path)
        if os.path.isfile(full):
            with open(full, encoding="utf-8") as f:
                for i, text in enumerate(f, 1):
                    if row.line in text:
                        return f"{row.path}:{i}"
            return f"{row.path}: (line not found: {row.line!r})"
    return f"{row.path}: (file not found)"


def run_check(row: Row) -> tuple:
    import torch
    import torch.distributed as dist

    import torch_tpu

    scope = dict(globals(), torch=torch, torch_tpu=torch_tpu, dist=dist)
    try:
        return bool(eval(row.check, scope)), ""
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}".splitlines()[0]


def results() -> list:
    return [(row, locate(row), *run_check(row)) for row in ROWS]


def markdown(rows=None) -> str:
    rows = results() if rows is None else rows
    libs = sorted({r.library for r in ROWS})
    versions = ", ".join(f"{lib} {_version(lib) or 'not installed here'}" for lib in libs if lib != "torch-tpu")
    out = [
        "# Compatibility: code written for TorchTPU, run on torch_tpu",
        "",
        "Every call other libraries make into `torch_tpu`, `torch.tpu`, the `tpu` device, `tpu_dist` and `TPU_*`",
        "variables: the caller's file and line (in the version installed here, or where it was read), what it",
        "expects, and what torch_tpu does. The status comes from running each row's check against torch_tpu.",
        "Generated by `python tools/compatibility.py > docs/compatibility.md`; `tests/python/test_compatibility.py`",
        "runs the checks and keeps this page equal to the tool's output.",
        "",
        f"Libraries: {versions}.",
        "",
        "| library | caller | call | expects | torch_tpu | status |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row, where, ok, err in rows:
        status = "works" if ok else (f"not provided: {row.reason}" if row.reason else f"**fails** ({err})")
        out.append(f"| {row.library} | `{where}` | {row.call} | {row.expects} | {row.answer} | {status} |")
    ok = sum(1 for _, _, good, _ in rows if good)
    reasoned = sum(1 for r, _, good, _ in rows if not good and r.reason)
    out += ["", f"{ok} of {len(rows)} calls work; {reasoned} are not provided, each with its reason.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a row without a reason fails")
    args = p.parse_args(argv)
    rows = results()
    failed = [(r, e) for r, _, ok, e in rows if not ok and not r.reason]
    if args.check:
        for r, e in failed:
            print(f"FAILED {r.library} {r.call}: {e}")
        return 1 if failed else 0
    sys.stdout.write(markdown(rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(2)
