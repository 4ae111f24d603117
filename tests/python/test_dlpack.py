"""DLPack and raw memory on tpu (issue 2/6, class 2): a tpu tensor through torch.from_dlpack,
__dlpack__ and back shares the exporter's memory; a consumer that cannot read device memory
refuses with its own error; nothing a user does with the protocol crashes the process, nor does
NaN input to the one CPU-fallback kernel the NaN/inf walk saw crash (LAPACK geev). Each case that
once crashed runs in a subprocess, so a crash fails the test instead of killing pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.dlpack import DLDeviceType

import torch_tpu  # noqa: F401  (registers the device)

pytestmark = pytest.mark.mode_dependent

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dlpack_device_is_the_extension_device():
    assert torch.ones(2, device="tpu").__dlpack_device__() == (DLDeviceType.kDLExtDev, 0)
    assert torch.ones(2).__dlpack_device__() == (DLDeviceType.kDLCPU, 0)  # others unchanged


@pytest.mark.parametrize("route", ["tensor", "capsule", "versioned"])
def test_tpu_to_tpu_shares_memory(route):
    t = torch.arange(6.0, device="tpu").reshape(2, 3)[:, 1:]
    if route == "tensor":
        u = torch.from_dlpack(t)
    elif route == "capsule":
        u = torch.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    else:
        u = torch.from_dlpack(t.__dlpack__(max_version=(1, 0)))
    assert u.device == t.device and u.shape == t.shape and u.stride() == t.stride()
    assert u.data_ptr() == t.data_ptr()
    torch.testing.assert_close(u.cpu(), torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    u.mul_(10)  # a write through either is seen through the other
    torch.testing.assert_close(t.cpu(), torch.tensor([[10.0, 20.0], [40.0, 50.0]]))
    t.add_(1)
    torch.testing.assert_close(u.cpu(), torch.tensor([[11.0, 21.0], [41.0, 51.0]]))
    v = u + u  # an op reads it like any tpu tensor
    torch.testing.assert_close(v.cpu(), 2 * t.cpu())


def test_the_shared_tensor_outlives_the_exporter():
    t = torch.full((4,), 3.0, device="tpu")
    u = torch.from_dlpack(t)
    del t
    torch.testing.assert_close(u.cpu(), torch.full((4,), 3.0))


def test_to_the_cpu_copies_and_without_a_copy_is_refused():
    t = torch.arange(4.0, device="tpu")
    c = torch.from_dlpack(t, device="cpu")
    assert c.device.type == "cpu"
    torch.testing.assert_close(c, torch.arange(4.0))
    with pytest.raises(ValueError, match="without copying"):
        torch.from_dlpack(t, device="cpu", copy=False)


def test_numpy_refuses_device_memory_as_for_any_accelerator():
    t = torch.ones(3, device="tpu")
    with pytest.raises((BufferError, RuntimeError), match="device"):
        np.from_dlpack(t)
    with pytest.raises(TypeError, match="cpu"):
        t.numpy()
    with pytest.raises(TypeError, match="cpu"):
        np.asarray(t)
    with pytest.raises(BufferError, match="gradient"):
        torch.ones(2, device="tpu", requires_grad=True).__dlpack__()


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_memory_torch_tpu_did_not_allocate_is_an_error_not_a_crash():
    # A tpu tensor over an address torch_tpu cannot vouch for (PyTorch's raw DLPack converters,
    # around torch_tpu's: a view's address is not an array's): reading or writing it raises instead
    # of following the pointer. Once, reads like this crashed.
    r = _run("""
        import torch, torch_tpu
        t = torch.arange(4.0, device="tpu")[1:]
        u = torch._C._from_dlpack(torch._C._to_dlpack(t))
        for f in (lambda: u.cpu(), lambda: u + 1, lambda: u.fill_(2), lambda: u.untyped_storage().resize_(64)):
            try:
                f()
            except RuntimeError as e:
                assert "not allocated by torch_tpu" in str(e), e
            else:
                raise SystemExit("no error")
        print(t.cpu().tolist(), "ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("[1.0, 2.0, 3.0] ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_round_trips_that_crashed_run_in_a_fresh_process():
    r = _run("""
        import torch, torch_tpu
        t = torch.arange(4.0, device="tpu")
        print(torch.from_dlpack(t, device="cpu").tolist())
        print(torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)).cpu().tolist())
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_eigvals_of_nan_is_an_error_not_the_cpu_kernels_crash():
    # The CPU fallback's LAPACK geev crashed the process on NaN input (on the CPU as well: the
    # NaN/inf walk's one crash). On tpu it is a RuntimeError; the process goes on.
    r = _run("""
        import torch, torch_tpu
        x = torch.randn(4, 4)
        x[0, 0] = float("nan")
        for f in (torch.linalg.eigvals, torch.linalg.eig):
            try:
                f(x.to("tpu"))
            except RuntimeError as e:
                assert "NaN or infinite" in str(e), e
            else:
                raise SystemExit("no error")
        print(torch.linalg.eigvals(torch.eye(2).to("tpu")).cpu().tolist(), "ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
