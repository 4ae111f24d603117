"""Guard for the test tiers (docs/testing.md): the gate runs every Python test file in at least
one mode, so each file holds a test that is not marked slow. Reads the files only."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _is_slow_mark(node: ast.AST) -> bool:
    # pytest.mark.slow, as a decorator, a pytestmark value or a param's marks
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _marks_slow(value: ast.AST) -> bool:
    if isinstance(value, (ast.List, ast.Tuple)):
        return any(_marks_slow(v) for v in value.elts)
    return _is_slow_mark(value)


def _gate_cases(fn: ast.FunctionDef) -> int:
    """How many of the test's cases the gate runs (parametrized cases counted one by one)."""
    if any(_is_slow_mark(d) for d in fn.decorator_list):
        return 0
    for d in fn.decorator_list:
        if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize"
                and len(d.args) >= 2 and isinstance(d.args[1], (ast.List, ast.Tuple))):
            cases = d.args[1].elts
            slow = [c for c in cases if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "param"
                    and any(k.arg == "marks" and _marks_slow(k.value) for k in c.keywords)]
            return len(cases) - len(slow)
    return 1


def files_the_gate_skips(folder: str) -> list[str]:
    """Test files under folder with no test the gate (-m "not slow") selects."""
    bad = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        module_slow = any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in s.targets)
                          and _marks_slow(s.value) for s in tree.body)
        tests = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name.startswith("test_")]
        if module_slow or sum(_gate_cases(t) for t in tests) == 0:
            bad.append(name)
    return bad


def test_every_test_file_runs_in_the_gate():
    bad = files_the_gate_skips(os.path.join(ROOT, "tests", "python"))
    assert not bad, (f"{bad}: every test of these files is marked slow, so the gate (scripts/test.sh) never runs "
                     "them; keep a cheaper case unmarked (a smaller count, one configuration) and leave the rest "
                     "to the full tier")


def test_the_guard_catches_a_file_with_only_slow_tests(tmp_path):
    (tmp_path / "test_fine.py").write_text(
        "import pytest\n@pytest.mark.slow\ndef test_a(): pass\ndef test_b(): pass\n")
    (tmp_path / "test_all_slow.py").write_text(
        "import pytest\n@pytest.mark.slow\ndef test_a(): pass\n"
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow)])\ndef test_b(n): pass\n")
    (tmp_path / "test_module_slow.py").write_text("import pytest\npytestmark = pytest.mark.slow\ndef test_a(): pass\n")
    (tmp_path / "test_one_fast_param.py").write_text(
        "import pytest\n@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow), 2])\n"
        "def test_b(n): pass\n")
    assert files_the_gate_skips(str(tmp_path)) == ["test_all_slow.py", "test_module_slow.py"]
