"""Writes through overlapping memory are refused on tpu where PyTorch refuses them (issue 3/7,
finding 3): a written-to tensor whose elements share memory (x.expand(2, 3).add_(1)), or one
partly over an input (x[1:].copy_(x[:-1])). The class: every OpInfo op with an in-place variant,
its input made internally overlapping, and an argument made a view one element off the input,
on the CPU and on tpu: each raises the same or neither does."""

import json
import os
import sys

import pytest
import torch

import torch_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from overlap_checks import INTERNAL, PARTIAL, overlap_cases, probe  # noqa: E402

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager


def _outcome(fn, make, device):
    try:
        written, args, kwargs = make(device)
        fn(written, *args, **kwargs)
        if device == "tpu":
            torch.tpu.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001
        text = str(e)
        return "internal" if INTERNAL in text else "partial" if PARTIAL in text else "other: " + type(e).__name__


def test_the_issue_examples():
    x = torch.arange(6.0, device="tpu")
    for f in (lambda: x[1:].copy_(x[:-1]), lambda: x[1:].add_(x[:-1]), lambda: torch.add(x[:-1], 1, out=x[1:])):
        with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
            f()
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.zeros(3, device="tpu").expand(2, 3).add_(1)
    assert x.cpu().tolist() == [0, 1, 2, 3, 4, 5]  # nothing was written
    # What PyTorch allows still works: the same view, a copy onto itself, disjoint views, fill_.
    results = []
    for device in ("cpu", "tpu"):
        x = torch.arange(6.0, device=device)
        x.add_(x)
        x.copy_(x)
        x[:3].mul_(x[3:])
        y = torch.zeros(3, device=device).expand(2, 3)
        y.fill_(1)
        results.append((x.cpu().tolist(), y.cpu().tolist()))
    assert results[0] == results[1] and results[0][0] == [0, 16, 40, 6, 8, 10], results


@pytest.mark.slow  # every OpInfo op (about 2 minutes): the full tier
def test_every_inplace_opinfo_overlap_raises_as_on_the_cpu():
    mismatches, raised = [], 0
    for name, kind, fn, make in overlap_cases():
        cpu, tpu = _outcome(fn, make, "cpu"), _outcome(fn, make, "tpu")
        raised += cpu in ("internal", "partial")
        # One side refusing the overlap while the other computes is the failure; which of two
        # errors comes first (the overlap or a shape check) may differ.
        if (cpu in ("internal", "partial") or tpu in ("internal", "partial")) and "ok" in (cpu, tpu):
            mismatches.append((name, kind, cpu, tpu))
    assert not mismatches, mismatches
    assert raised > 100, raised


@pytest.mark.slow
def test_the_table_is_what_the_tool_finds():
    with open(os.path.join(ROOT, "torch_tpu", "_overlap_checks.json")) as f:
        committed = json.load(f)
    if committed["torch"] != torch.__version__:
        pytest.skip(f"the table was written for torch {committed['torch']}")
    found = probe()
    assert found == {kind: committed.get(kind, []) for kind in found}, (
        "torch_tpu/_overlap_checks.json is stale: python tools/overlap_checks.py --write torch_tpu/_overlap_checks.json")
