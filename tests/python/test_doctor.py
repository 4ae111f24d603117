"""torch-tpu doctor: exactly the expected findings on a fixture with one of every kind, real
code scanned without a parse error, rewrites that run, SARIF that validates, bad input."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from torch_tpu import doctor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "python", "doctor_fixture")


def cli(*args, cwd=None, **extra_env):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
    return subprocess.run([sys.executable, "-m", "torch_tpu", "doctor", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def expected(folder):
    """(file, line, rule) of every '# TPUnnn' marker in the fixture's code lines."""
    out = set()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                for i, line in enumerate(f, 1):
                    for rule in re.findall(r"#.*?(TPU\d{3})", line):
                        out.add((name, i, rule))
    return out


def test_the_fixture_gives_exactly_the_expected_findings():
    report = doctor.scan([FIXTURE])
    assert report.errors == [] and report.files == 4
    got = {(os.path.basename(f.path), f.line, f.rule) for f in report.findings}
    assert got == expected(FIXTURE)
    assert not any(f.path.endswith("clean.py") for f in report.findings)  # look-alikes are not findings
    assert {f.rule for f in report.findings} == set(doctor.RULES)  # every kind is exercised


def test_comments_docstrings_and_plain_comparisons_are_not_findings():
    src = '"""Runs on "cuda"."""\n# model.to("cuda")\nok = mode == "cuda"\ndef f():\n    """cuda"""\n'
    assert doctor.scan_source(src) == []
    assert [f.rule for f in doctor.scan_source('same = x.device.type == "cuda"\n')] == ["TPU001"]


def test_fix_adds_import_torch_after_docstring_and_future_imports():
    src = '"""Doc."""\nfrom __future__ import annotations\nimport os\nx = t.to("cuda")\n'
    fixed = doctor.apply_fixes(src, doctor.scan_source(src))
    assert fixed.splitlines()[:3] == ['"""Doc."""', "from __future__ import annotations", "import torch"]
    compile(fixed, "<fixed>", "exec")
    src = "import torch as th\nth.cuda.synchronize()\n"
    assert doctor.apply_fixes(src, doctor.scan_source(src)).startswith("import torch\nimport torch as th\n")


def test_fix_keeps_lines_after_a_form_feed_in_place():
    # Python numbers lines at line feeds only; a form feed (a page break in old sources) is not
    # a line break for ast, so the fix must not count it as one.
    src = "import torch\n# page\x0cbreak\nx = torch.zeros(3).cuda()\ny = 1\n"
    findings = doctor.scan_source(src)
    assert [(f.rule, f.line) for f in findings] == [("TPU002", 3)]
    fixed = doctor.apply_fixes(src, findings)
    assert fixed == src.replace(".cuda()", ".to(torch.accelerator.current_accelerator().type)")


def test_padding_estimate():
    (f,) = doctor.scan_source("import torch.nn as nn\nnn.Linear(1000, 300)\n")
    # 1024 x 384 tiles for 1000 x 300 of work
    assert f"{1024 * 384 / (1000 * 300) - 1:.0%}" in f.message
    assert doctor.scan_source("import torch.nn as nn\nnn.Linear(4096, 11008)\nnn.Linear(16, 16)\n") == []


@pytest.mark.slow  # five fresh interpreters; the gate keeps the rewrites' text checks above
def test_fix_rewrites_run_and_give_the_same_results(tmp_path):
    work = tmp_path / "code"
    shutil.copytree(FIXTURE, work)
    script = work / "portable.py"
    env = dict(os.environ, TORCH_TPU_FALLBACK="error")
    # As written it needs CUDA, which this torch has not got.
    before = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert before.returncode != 0 and "CUDA" in before.stderr

    diff = cli("--diff", str(script))
    assert diff.returncode == 1 and "+w = torch.randn(8, 8).to(torch.accelerator.current_accelerator().type)" in diff.stdout
    assert script.read_text() == open(os.path.join(FIXTURE, "portable.py")).read()  # --diff changes nothing

    on_cpu = tmp_path / "cpu"
    shutil.copytree(FIXTURE, on_cpu)
    assert cli("--fix", "--device", '"cpu"', str(on_cpu / "portable.py")).returncode == 1
    assert cli("--fix", str(script)).returncode == 1
    assert cli(str(script)).returncode == 0  # nothing left to find

    runs = {}
    for name, path in (("accelerator", script), ("cpu", on_cpu / "portable.py")):
        r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = json.loads(r.stdout)
    assert runs["accelerator"]["device"] == "tpu:0" and runs["cpu"]["device"] == "cpu"
    import torch

    torch.testing.assert_close(torch.tensor(runs["accelerator"]["y"]), torch.tensor(runs["cpu"]["y"]))


def test_sarif_validates_and_locates_every_finding(tmp_path):
    from sarif_pydantic import Sarif

    out = tmp_path / "doctor.sarif"
    r = cli(FIXTURE, "--format", "sarif", "--output", str(out))
    assert r.returncode == 1 and r.stdout == ""
    doc = json.loads(out.read_text())
    log = Sarif.model_validate(doc)
    assert log.version == "2.1.0"
    results = doc["runs"][0]["results"]
    assert len(results) == len(expected(FIXTURE))
    rules = doc["runs"][0]["tool"]["driver"]["rules"]
    for res in results:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        loc = res["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"].endswith(".py") and loc["region"]["startLine"] >= 1
    # Not SARIF: a level outside the standard's set is refused by the model.
    doc["runs"][0]["results"][0]["level"] = "fatal"
    with pytest.raises(Exception):
        Sarif.model_validate(doc)


def test_real_code_parses_and_gives_findings():
    import accelerate

    report = doctor.scan([os.path.dirname(accelerate.__file__), os.path.join(ROOT, "benchmarks")])
    assert report.errors == [] and report.files > 50
    rules = {f.rule for f in report.findings}
    assert {"TPU001", "TPU003", "TPU004"} <= rules
    for f in report.findings:
        assert f.fix is None or f.rule in ("TPU001", "TPU002", "TPU003")


def test_bad_input_gives_clear_messages_and_keeps_partial_results(tmp_path):
    r = cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such file or folder" in r.stderr
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "good.py").write_text('import torch\nx = torch.ones(2).to("cuda")\n')
    r = cli(str(tmp_path), "--format", "json")
    assert r.returncode == 2 and "broken.py" in r.stderr and "SyntaxError" in r.stderr
    report = json.loads(r.stdout)
    assert report["files"] == 2 and [f["rule"] for f in report["findings"]] == ["TPU001"]
    assert cli(str(tmp_path / "good.py"), "--exit-zero").returncode == 0


RUN_SCRIPT = """
import sys, torch
x = torch.randn(8, 8, device="tpu")
for n in (8, 7, 6):
    v = torch.linalg.eigvals(x[:n, :n])  # no tpu lowering: runs on the CPU
    s = (x[:n] @ x[:, :n]).sum()
    print(float(s))
if sys.argv[1] == "raise":
    raise ValueError("the script's own bug")
"""


def test_run_reports_fallbacks_compiles_and_host_reads_and_keeps_them_when_the_script_raises(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(RUN_SCRIPT)
    for arg, status in (("ok", 0), ("raise", 1)):
        out = tmp_path / f"{arg}.json"
        r = cli("--format", "json", "--output", str(out), "--run", str(script), arg, TORCH_TPU_CACHE_DIR="off")
        assert r.returncode == status, r.stderr[-2000:]
        rep = json.loads(out.read_text())
        (fb,) = rep["fallbacks"]
        assert fb["op"] == "aten::_linalg_eigvals" and fb["calls"] == 3
        assert fb["first_call"] == f"{script}:5"
        assert rep["compiles"]["count"] >= 3  # three shapes of the product
        assert rep["host_reads"]["count"] >= 3  # the three float(s)
        assert any(o["op"] == "aten::mm" for o in rep["top_ops"])
        if arg == "raise":
            assert rep["error"] == {"type": "ValueError", "message": "the script's own bug", "at": f"{script}:9"}
    text = cli("--run", str(script), "ok")
    assert text.returncode == 0 and "aten::_linalg_eigvals: 3 calls, first from" in text.stdout


def test_run_bad_input(tmp_path):
    r = cli("--run", str(tmp_path / "missing.py"))
    assert r.returncode == 2 and "no such script" in r.stderr
    r = cli("--run")
    assert r.returncode == 2 and "needs a script" in r.stderr


@pytest.mark.slow  # Dynamo's first compile in a fresh interpreter; the gate keeps --run's report
def test_run_reports_graph_breaks(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text("import torch\n"
                      "@torch.compile(backend='tpu')\n"
                      "def f(x):\n"
                      "    y = x.sin()\n"
                      "    if y.sum().item() > 0:  # a data-dependent branch: Dynamo breaks the graph here\n"
                      "        return y * 2\n"
                      "    return y\n"
                      "print(f(torch.ones(4, device='tpu')).cpu())\n")
    out = tmp_path / "r.json"
    r = cli("--format", "json", "--output", str(out), "--run", str(script))
    assert r.returncode == 0, r.stderr[-2000:]
    breaks = json.loads(out.read_text())["graph_breaks"]
    assert breaks and sum(b["count"] for b in breaks) >= 1
