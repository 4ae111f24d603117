"""Guards over the C++ sources: cheap (they read files, build nothing), and each
fails with a message that says what to do. Each rule is a function over a
repository root that returns its violations, shown here to catch a violation
planted in a temporary tree as well as to pass on the real one."""

from __future__ import annotations

import os
import re

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPP_SUFFIXES = (".h", ".hpp", ".cc", ".cpp", ".cxx", ".cu", ".inc")
MAX_SOURCE_LINES = 1200
# `#include "plugins/..."`, `#include "csrc/plugins/..."` or `#include <plugins/...>`,
# with or without a leading "./" or "../".
PLUGIN_INCLUDE = re.compile(r'^\s*#\s*include\s*["<](?:\.{1,2}/)*(?:csrc/)?plugins/')


def _cpp_sources(root: str):
    """Yields (path relative to root, absolute path) of every C++ source under root/csrc."""
    base = os.path.join(root, "csrc")
    for folder, dirs, files in os.walk(base):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(CPP_SUFFIXES):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, root).replace(os.sep, "/"), path


def oversized_sources(root: str, limit: int = MAX_SOURCE_LINES) -> list[str]:
    """C++ sources under csrc/ longer than `limit` lines, each as 'path: N lines'."""
    out = []
    for rel, path in _cpp_sources(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            n = sum(1 for _ in f)
        if n > limit:
            out.append(f"{rel}: {n} lines")
    return out


def plugin_includes_outside_plugins(root: str) -> list[str]:
    """Includes of anything under csrc/plugins/ from a file of csrc/ outside that folder,
    each as 'path:line: the include'. (tests/cpp may include a plugin's headers to test
    that plugin's own code; the product may not.)"""
    out = []
    for rel, path in _cpp_sources(root):
        if rel.startswith("csrc/plugins/"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if PLUGIN_INCLUDE.match(line):
                    out.append(f"{rel}:{i}: {line.strip()}")
    return out


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_cpp_source_is_over_the_line_limit():
    bad = oversized_sources(REPO_ROOT)
    assert not bad, (
        f"C++ sources over {MAX_SOURCE_LINES} lines: {bad}. Split the file by concern (one op "
        "family, one layer's job per file: e.g. ops/special.cpp beside ops/special_bessel.cpp), "
        "not at an arbitrary line.")


def test_line_limit_guard_catches_a_long_file(tmp_path):
    _write(tmp_path, "csrc/ops/short.cpp", "int a;\n" * 10)
    _write(tmp_path, "csrc/ops/long.cpp", "int b;\n" * (MAX_SOURCE_LINES + 1))
    _write(tmp_path, "csrc/ops/notes.txt", "x\n" * (MAX_SOURCE_LINES + 1))  # not a C++ source
    assert oversized_sources(str(tmp_path)) == [f"csrc/ops/long.cpp: {MAX_SOURCE_LINES + 1} lines"]
    _write(tmp_path, "csrc/ops/long.cpp", "int b;\n" * MAX_SOURCE_LINES)
    assert oversized_sources(str(tmp_path)) == []


def test_nothing_outside_plugins_includes_a_plugin():
    bad = plugin_includes_outside_plugins(REPO_ROOT)
    assert not bad, (
        f"Files outside csrc/plugins/ include a plugin's code: {bad}. Go through the seam "
        "instead: runtime/plugin.h's PluginSupport and its registration by platform name "
        "(client options, compile options, launch hooks), and ops/kernel_slots.h for a "
        "plugin's own lowerings; the plugin's folder registers them (docs/architecture.md, "
        "'The plugin seam').")


@pytest.mark.parametrize("include", [
    '#include "plugins/cpu/custom_calls.h"',
    '#include "csrc/plugins/cpu/cpu_plugin.h"',
    '  #  include <plugins/cuda/x.h>',
    '#include "../plugins/cpu/host_kernels.h"',
])
def test_plugin_include_guard_catches_an_include_from_outside(tmp_path, include):
    _write(tmp_path, "csrc/plugins/cpu/cpu_plugin.cpp", '#include "plugins/cpu/cpu_plugin.h"\n')
    _write(tmp_path, "csrc/runtime/plugin.h", '#include "pjrt/pjrt.h"\n')
    _write(tmp_path, "csrc/ops/nn.cpp", f'#include "ops/common.h"\n{include}\n// plugins/cpu is fine here\n')
    assert plugin_includes_outside_plugins(str(tmp_path)) == [f"csrc/ops/nn.cpp:2: {include.strip()}"]


# The layers, top to bottom: a file may include its own layer and the layers below it. The same
# order is stated in docs/architecture.md ("Layers"). The dispatcher (dispatch/) sits above the
# execution modes and hands each op to one; the modes (a tuple: one layer of siblings) run the
# steps they share, which sit below them (op_steps/: plan, meta run, signature, lowering,
# binding); aten/ is the PyTorch glue those steps build on. plugins/ sits above ops/ and
# runtime/: a plugin fills the kernel slots and registers with the runtime; nothing below
# includes it. A lower layer reaches a higher one only through an interface the higher one
# installs (runtime/pending.h, aten/tpu.h's DeferredCopies, op_steps/recording.h).
MODES = ("compile", "fused", "strict")
LAYERS = ["python", "distributed", "dispatch", MODES, "op_steps", "aten", "plugins", "ops", "runtime", "ir",
          "pjrt"]
# Upward includes allowed by name ('path -> layer'); none today. A new one fails; a listed one
# that is gone must leave here.
KNOWN_UPWARD: set[str] = set()
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([a-z_]+)/')


def _rank(folder: str):
    """The position of csrc/<folder> in LAYERS (0 = top), or None for a folder of no layer."""
    for i, layer in enumerate(LAYERS):
        if folder == layer or (isinstance(layer, tuple) and folder in layer):
            return i
    return None


def _layer_text() -> str:
    return " > ".join("{" + ", ".join(x) + "}" if isinstance(x, tuple) else x for x in LAYERS)


def _local_includes(root: str):
    """Yields (path relative to root, its csrc/ folder, the csrc/ folder it includes from)."""
    for rel, path in _cpp_sources(root):
        folder = rel.split("/")[1]
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = LOCAL_INCLUDE.match(line)
                if m:
                    yield rel, folder, m.group(1)


def upward_includes(root: str) -> set[str]:
    """Includes from a layer of csrc/ into a layer above it, as 'path -> layer'."""
    out = set()
    for rel, folder, target in _local_includes(root):
        mine, theirs = _rank(folder), _rank(target)
        if mine is not None and theirs is not None and theirs < mine:
            out.add(f"{rel} -> {target}")
    return out


def mode_includes(root: str) -> set[str]:
    """Includes from one execution mode's folder into another mode's, as 'path -> mode'."""
    return {f"{rel} -> {target}" for rel, folder, target in _local_includes(root)
            if folder in MODES and target in MODES and folder != target}


def test_includes_go_down_the_layers():
    found = upward_includes(REPO_ROOT)
    new, gone = sorted(found - KNOWN_UPWARD), sorted(KNOWN_UPWARD - found)
    assert not new, (f"includes up the layers ({_layer_text()}): {new}. Move what the lower layer needs "
                     "down, or reach the upper layer through an interface it installs (as fused eager "
                     "installs runtime/pending.h's hooks), instead of including upwards.")
    assert not gone, f"{gone} no longer include upwards: remove them from KNOWN_UPWARD in this file"


def test_layer_guard_catches_an_upward_include(tmp_path):
    _write(tmp_path, "csrc/ops/nn.cpp", '#include "ops/common.h"\n#include "ir/ir.h"\n#include "runtime/runtime.h"\n')
    _write(tmp_path, "csrc/runtime/runtime.cpp", '#include "ir/ir.h"\n#include "strict/strict.h"\n')
    _write(tmp_path, "csrc/op_steps/op_plan.cpp", '#include "aten/tpu.h"\n#include "dispatch/fallback.h"\n')
    _write(tmp_path, "csrc/fused/fused.cpp", '#include "op_steps/op_plan.h"\n#include "fused/engine/x.h"\n')
    _write(tmp_path, "csrc/pjrt/pjrt.cpp", '#include "pjrt_c_api.h"\n')
    assert upward_includes(str(tmp_path)) == {"csrc/runtime/runtime.cpp -> strict",
                                              "csrc/op_steps/op_plan.cpp -> dispatch"}


def test_no_mode_includes_another():
    bad = sorted(mode_includes(REPO_ROOT))
    assert not bad, (f"an execution mode includes another ({', '.join(MODES)}): {bad}. What two modes share "
                     "goes down into op_steps/; where one mode needs another's engine (capture records "
                     "through fused eager's pending graph), the engine installs an interface declared "
                     "there (op_steps/recording.h) and the other mode calls that.")


def test_mode_guard_catches_a_mode_including_another(tmp_path):
    _write(tmp_path, "csrc/fused/fused.cpp", '#include "fused/fused.h"\n#include "op_steps/op_plan.h"\n')
    _write(tmp_path, "csrc/fused/engine/fused_graph.h", '#include "runtime/runtime.h"\n')
    _write(tmp_path, "csrc/compile/capture.cpp", '#include "op_steps/recording.h"\n#include "fused/engine/fused_graph.h"\n')
    _write(tmp_path, "csrc/strict/strict.cpp", '#include "strict/strict.h"\n#include "compile/capture.h"\n')
    _write(tmp_path, "csrc/dispatch/dispatcher.cpp", '#include "strict/strict.h"\n#include "fused/fused.h"\n')
    assert mode_includes(str(tmp_path)) == {"csrc/compile/capture.cpp -> fused", "csrc/strict/strict.cpp -> compile"}
    # Siblings are not above one another: the layer guard leaves them to this one.
    assert upward_includes(str(tmp_path)) == set()
