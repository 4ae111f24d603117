"""tpu_dist's XLA transport and torch.tpu.comm: collectives as XLA programs over 4 devices
of one process (TORCH_TPU_CPU_DEVICES=4), ranks as threads. Each case runs
dist_workers/local.py in a process of its own (the device count is fixed at start)."""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_workers", "local.py")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed")


def _local(mode, timeout=240):
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES="4", TORCH_TPU_PLUGIN="cpu", TORCH_TPU_FALLBACK="error")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, LOCAL, mode], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_every_collective_against_gloo_over_4_devices():
    out = _local("collectives")
    assert "ok collectives: 58 checks on each of 4 ranks" in out, out
    assert "ok sub-group on tpu:1 and tpu:3" in out, out


def test_failures_raise_and_the_devices_keep_working():
    out = _local("failures")
    for line in ("absent rank", "mismatched shapes", "mismatched dtypes", "tensor on the wrong device",
                 "receive without a sender", "local_group arguments", "ranks bind their first collective's device",
                 "two ranks on one device", "group after failures"):
        assert f"ok {line}" in out, out


def test_comm_against_the_host():
    out = _local("comm")
    assert "ok comm:" in out and "ok comm errors" in out, out
