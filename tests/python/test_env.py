"""The environment registry: every variable is declared once, README's table is
generated from it, and `python -m torch_tpu env` prints the values in force."""

import os
import re
import subprocess
import sys

import pytest

import torch_tpu
from torch_tpu import _env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Names of our variables as the code spells them (TPU_LAUNCH_BLOCKING is
# TorchTPU's public name).
NAME = re.compile(r"\b(TORCH_TPU_[A-Z0-9_]+|TPU_LAUNCH_BLOCKING)\b")


def _readme_table():
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- env-table:begin -->\n(.*?)<!-- env-table:end -->", text, re.S)
    assert m, "README.md lacks the env-table markers"
    return m.group(1).strip()


def test_readme_table_is_the_registry():
    assert _readme_table() == _env.markdown_table(), (
        "README's environment table differs from the registry (csrc/runtime/env.cpp): "
        "regenerate it with `python -m torch_tpu env --markdown`")


def test_every_variable_the_code_names_is_declared():
    declared = {v.name for v in _env.variables()}
    seen = {}
    for folder in ("csrc", "torch_tpu", "tools", "scripts", "benchmarks", "tests", ".ci"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith((".cpp", ".h", ".py", ".sh")) and f != "run":
                    continue
                path = os.path.join(dirpath, f)
                for name in NAME.findall(open(path, errors="replace").read()):
                    seen.setdefault(name, path)
    missing = {n: p for n, p in seen.items() if n not in declared}
    assert not missing, f"variables read but not declared in csrc/runtime/env.cpp: {missing}"


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
    assert md.returncode == 0 and md.stdout.strip() == _env.markdown_table()


def test_a_malformed_value_is_a_clear_error_at_start():
    code = "import torch, torch_tpu; torch.ones(1, device='tpu')"
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES="two")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "TORCH_TPU_CPU_DEVICES='two' must be a positive integer" in r.stderr
