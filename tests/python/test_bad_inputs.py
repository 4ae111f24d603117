"""Bad inputs must fail the way they fail on the CPU (same exception types, clear
messages) and must leave the device usable."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _device_still_works():
    x = torch.ones(4, device="tpu") * 3
    assert x.cpu().tolist() == [3.0] * 4


def test_add_shape_mismatch_same_error_as_cpu():
    cpu_err = _error_of(lambda: torch.ones(3) + torch.ones(4))
    tpu_err = _error_of(lambda: torch.ones(3, device="tpu") + torch.ones(4, device="tpu"))
    assert isinstance(cpu_err, RuntimeError)
    assert type(tpu_err) is type(cpu_err), repr(tpu_err)
    msg = str(tpu_err)
    assert "3" in msg and "4" in msg, msg  # names the mismatching sizes
    _device_still_works()


def test_matmul_shape_mismatch():
    with pytest.raises(RuntimeError, match=r"2x3 and 4x5|\[2, 3\] X \[4, 5\]"):
        torch.ones(2, 3, device="tpu") @ torch.ones(4, 5, device="tpu")
    with pytest.raises(RuntimeError):
        torch.matmul(torch.ones(2, 2, 3, device="tpu"), torch.ones(2, 4, 5, device="tpu"))
    _device_still_works()


@pytest.mark.parametrize("order", ["cpu_first", "tpu_first"])
def test_mixing_cpu_and_tpu_tensors(order):
    c = torch.ones(3)
    t = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError) as info:
        (c + t) if order == "cpu_first" else (t + c)
    msg = str(info.value)
    assert "cpu" in msg and "tpu" in msg, msg
    with pytest.raises(RuntimeError) as info:
        torch.mm(torch.ones(2, 2), torch.ones(2, 2, device="tpu"))
    msg = str(info.value)
    assert "cpu" in msg and "tpu" in msg, msg


@pytest.mark.parametrize("order", ["cpu_first", "tpu_first"])
def test_mixing_devices_in_an_op_that_falls_back(order):
    """The CPU fallback must apply the same device check as native kernels
    instead of silently moving the CPU operand."""
    import torch_tpu

    c = torch.ones(3)
    t = torch.ones(3, device="tpu")
    a, b = (c, t) if order == "cpu_first" else (t, c)
    with torch_tpu.lowerings_disabled("linalg_cross"), pytest.raises(RuntimeError) as info:
        torch.linalg.cross(a, b)
    msg = str(info.value)
    assert "cpu" in msg and "tpu" in msg, msg


def test_cpu_zero_dim_tensor_is_allowed():
    # Like CUDA: a 0-d CPU tensor acts as a scalar.
    t = torch.ones(3, device="tpu") + torch.tensor(2.0)
    assert t.device.type == "tpu"
    assert t.cpu().tolist() == [3.0, 3.0, 3.0]


def test_invalid_device_index():
    n = torch.tpu.device_count()
    with pytest.raises(RuntimeError) as info:
        torch.empty(2, device="tpu:99")
    msg = str(info.value)
    assert "tpu:99" in msg, msg
    assert "tpu:0" in msg and str(n) in msg, f"the message should name the available devices: {msg}"
    with pytest.raises(RuntimeError):
        torch.ones(2).to("tpu:99")
    with pytest.raises(RuntimeError):
        torch.tpu.set_device(99)
    assert torch.tpu.current_device() == 0
    _device_still_works()


def test_huge_allocation_raises_oom_and_device_recovers():
    gc.collect()  # an earlier test's garbage freed during this one would read as a change
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(2**62 // 4, device="tpu")
    assert "out of memory" in str(info.value)
    limit = torch.tpu.get_device_properties().total_memory
    with pytest.raises(torch.OutOfMemoryError):
        torch.ones(limit // 4 + (1 << 20), device="tpu")
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() == before
    _device_still_works()


def test_oom_is_a_runtime_error_too():
    # torch.OutOfMemoryError subclasses RuntimeError: generic handlers keep working.
    with pytest.raises(RuntimeError):
        torch.empty(2**62 // 4, device="tpu")


def test_index_out_of_range():
    t = torch.zeros(3, 4, device="tpu")
    with pytest.raises(IndexError):
        t[5]
    with pytest.raises(IndexError):
        t[:, 7]
    with pytest.raises(IndexError):
        t.select(0, -4)
    _device_still_works()


def test_index_tensor_out_of_range():
    t = torch.zeros(3, device="tpu")
    idx = torch.tensor([5], device="tpu")
    # The CPU raises IndexError; a device that silently clamps would be a bug.
    with pytest.raises((IndexError, RuntimeError)):
        t[idx].cpu()
    _device_still_works()


def test_one_index_per_line_scatter_out_of_range():
    # Lowered as a select rather than a scatter: the range check must still fire,
    # for indices past the end and for negative ones (scatter does not wrap).
    t = torch.zeros(3, 4, device="tpu")
    for bad in (4, -1):
        with pytest.raises(IndexError):
            t.scatter(1, torch.full((3, 1), bad, device="tpu"), 1.0).cpu()
    _device_still_works()


@pytest.mark.parametrize("make", ["to", "empty"])
def test_unsupported_dtype(make):
    # complex32 has no XLA type: no plugin computes it.
    with pytest.raises((TypeError, RuntimeError)) as info:
        if make == "to":
            torch.ones(2, dtype=torch.complex32).to("tpu")
        else:
            torch.empty(2, dtype=torch.complex32, device="tpu")
    msg = str(info.value)
    assert "ComplexHalf" in msg or "complex32" in msg, msg
    assert "not supported" in msg or "unsupported" in msg.lower(), msg
    _device_still_works()


def _run_with_plugin(plugin: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TORCH_TPU_PLUGIN"] = plugin
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = "import torch, torch_tpu\ntorch.ones(1, device='tpu')\nprint('NO ERROR')\n"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def _failure_with_plugin(plugin: str) -> str:
    """The output of a process that must fail to start the runtime with this plugin."""
    r = _run_with_plugin(plugin)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "NO ERROR" not in out
    return out


@pytest.mark.skipif(_has_libtpu(), reason="libtpu is installed here")
def test_missing_tpu_plugin_says_what_to_install():
    out = _failure_with_plugin("tpu")
    assert "pip install libtpu" in out, out[-2000:]


def test_nonexistent_plugin_path():
    out = _failure_with_plugin("/nonexistent/plugin.so")
    assert "/nonexistent/plugin.so" in out, out[-2000:]
    assert "TORCH_TPU_PLUGIN" in out, out[-2000:]


@pytest.mark.skipif(_has_libtpu(), reason="libtpu is installed here")
def test_missing_plugin_is_not_available_instead_of_crashing():
    env = dict(os.environ, TORCH_TPU_PLUGIN="tpu")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import torch, torch_tpu\n"
            "print(torch.tpu.is_available(), torch.tpu.device_count())\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False 0"
