"""docs/compatibility.md is what tools/compatibility.py finds now: every call other libraries
make into torch_tpu, located in the installed versions, and each row's check run against
torch_tpu (issue 3/6)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "compatibility.py")


def test_every_call_works_or_has_its_reason_and_the_page_is_current():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "**fails**" not in r.stdout, [line for line in r.stdout.splitlines() if "**fails**" in line]
    assert "not found" not in r.stdout, [line for line in r.stdout.splitlines() if "not found" in line]
    with open(os.path.join(ROOT, "docs", "compatibility.md"), encoding="utf-8") as f:
        page = f.read()
    # Line numbers and versions are those of the libraries installed here; the rows must match.
    assert _rows(page) == _rows(r.stdout), "docs/compatibility.md is stale: python tools/compatibility.py > " \
        "docs/compatibility.md"


def _rows(page: str) -> list:
    return [re.sub(r"\.py:\d+`", ".py`", line) for line in page.splitlines() if not line.startswith("Libraries:")]
