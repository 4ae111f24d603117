"""The environment registry: every variable is declared once, docs/environment.md is
generated from it, and `python -m torch_tpu env` prints the values in force. (That the code
reads only declared variables, and only through the registry: test_guard_docs_env.py.)"""

import os
import subprocess
import sys

import pytest

import torch_tpu
from torch_tpu import _env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_guard_docs_env  # noqa: E402


def test_docs_environment_md_is_the_registry():
    with open(os.path.join(ROOT, "docs", "environment.md")) as f:
        page = f.read()
    assert page == _env.markdown_page(), (
        "docs/environment.md differs from the registry (csrc/runtime/env.cpp): regenerate it with "
        f"`{_env.REGENERATE}` (after a rebuild, so that the extension has the registry's changes)")


def test_the_guard_reads_the_registry_as_the_extension_does():
    assert test_guard_docs_env.declared_names(ROOT) == {v.name for v in _env.variables()}, (
        "csrc/runtime/env.cpp and the built extension declare different variables: rebuild "
        "(cmake --build build)")


def test_each_variable_is_declared_once_with_a_meaning():
    names = [v.name for v in _env.variables()]
    assert len(names) == len(set(names))
    for v in _env.variables():
        assert v.meaning and v.scope and v.type, v


def test_undeclared_names_are_refused():
    with pytest.raises(KeyError, match="not declared"):
        _env.get("TORCH_TPU_" "NO_SUCH_VARIABLE")  # split: the scan above must not see it


def test_python_m_torch_tpu_env_prints_every_variable_with_its_value():
    env = dict(os.environ, TORCH_TPU_FUSE_MAX_OPS="77")
    env.pop("TORCH_TPU_LOG_RECOMPILES", None)
    r = subprocess.run([sys.executable, "-m", "torch_tpu", "env"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert set(lines) == {v.name for v in _env.variables()}
    assert "'77'" in lines["TORCH_TPU_FUSE_MAX_OPS"]
    assert "unset; default 0" in lines["TORCH_TPU_LOG_RECOMPILES"]
    md = subprocess.run([sys.executable, "-m", "torch_tpu", "env", "--markdown"], capture_output=True, text=True,
                        timeout=300)
    assert md.returncode == 0 and md.stdout == _env.markdown_page()
    assert _env.markdown_table() in md.stdout


def test_a_malformed_value_is_a_clear_error_at_start():
    code = "import torch, torch_tpu; torch.ones(1, device='tpu')"
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES="two")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "TORCH_TPU_CPU_DEVICES='two' must be a positive integer" in r.stderr
