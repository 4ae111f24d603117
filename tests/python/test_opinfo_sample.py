"""The OpInfo sweep (tools/opinfo_sweep.py) on a representative sample of PyTorch's
OpInfo database (tools/opinfo_sample.txt): every (variant, dtype) pair that passed
natively when tests/python/opinfo_baseline.json was recorded must still pass natively
(same results as the CPU, no CPU fallback). Units run in worker subprocesses, so a crash
fails this test instead of killing pytest. Regenerate the baseline after an improvement:

    python tools/opinfo_sweep.py --ops-file tools/opinfo_sample.txt --workers 2 \\
        --write-baseline tests/python/opinfo_baseline.json
"""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO_ROOT, "tools")
BASELINE = os.path.join(REPO_ROOT, "tests", "python", "opinfo_baseline.json")
SAMPLE = os.path.join(TOOLS, "opinfo_sample.txt")


def _op_db():
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as e:  # torch's test helpers need expecttest
        pytest.skip(f"PyTorch's OpInfo database is not importable: {e}")
    return op_db


# The gate runs every third variant of the sample (shard 0 of 3); the full tier the whole sample.
@pytest.mark.parametrize("shard", [pytest.param((0, 1), marks=pytest.mark.slow, id="whole"),
                                   pytest.param((0, 3), id="third")])
def test_opinfo_sample_no_regressions(shard):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import opinfo_sweep

    op_db = _op_db()
    with open(BASELINE) as f:
        baseline = json.load(f)
    ops = set(opinfo_sweep.read_ops_file(SAMPLE))
    units = opinfo_sweep.enumerate_units(
        op_db, ops, baseline["meta"]["dtypes"], shard, True, baseline["meta"]["max_samples"])
    assert units, "the sample selects no OpInfo variant"
    variants = {u["variant"] for u in units}
    results, _ = opinfo_sweep.sweep(units, workers=2, timeout=120, snapshot=False)

    regressions = []
    for key in baseline["native_pass"]:
        if shard != (0, 1) and key.split("|")[0] not in variants:
            continue  # another shard's
        rec = results.get(key)
        if rec is None:
            regressions.append(f"{key}: no longer run (OpInfo or sample list changed?)")
        elif rec["status"] not in ("native_pass", "grad_native_pass"):
            regressions.append(f"{key}: {rec['status']}: {rec.get('message', '')}")
    improved = sorted(k for k, r in results.items()
                      if r["status"] in ("native_pass", "grad_native_pass")
                      and k not in set(baseline["native_pass"]))
    if improved:
        print(f"{len(improved)} pairs now pass natively that the baseline does not list "
              f"(regenerate it): {', '.join(improved)}")
    assert not regressions, (f"{len(regressions)} (variant, dtype) pairs no longer pass "
                             "natively:\n" + "\n".join(regressions))
