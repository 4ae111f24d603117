"""Strict and debug eager, index checks, multiple devices, metrics."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_tpu

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code, **env):
    e = dict(os.environ)
    e.update(env)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                          timeout=300)


def test_mode_api():
    initial = torch_tpu.get_mode()
    with torch_tpu.mode("debug"):
        assert torch_tpu.get_mode() == "debug"
        assert (torch.ones(3, device="tpu") * 2).sum().item() == 6
    with torch_tpu.mode("fused"):
        assert torch_tpu.get_mode() == "fused"
        assert (torch.ones(3, device="tpu") * 2).sum().item() == 6
    assert torch_tpu.get_mode() == initial
    with pytest.raises(ValueError):
        torch_tpu.set_mode("turbo")


def test_out_of_range_index_raises_at_next_host_read_in_strict_mode():
    x = torch.arange(5.0, device="tpu")
    y = x[torch.tensor([1, 7], device="tpu")]  # launches; nothing read yet
    with pytest.raises(IndexError, match="index out of range in aten::index"):
        y.cpu()
    # The device keeps working afterwards.
    assert x.sum().item() == 10


def test_a_failed_index_check_queued_after_a_read_is_raised_later_not_lost():
    # A read waits for the programs it depends on and runs their index checks;
    # a check of a program queued after it runs at the first read after that
    # program finished, or at synchronize, whichever comes first.
    x = torch.arange(5.0, device="tpu")
    total = x.sum()
    bad = x[torch.tensor([1, 7], device="tpu")] * 2  # queued after `total`
    try:
        assert total.item() == 10  # raises only if `bad` already finished
    except IndexError:
        pass
    else:
        with pytest.raises(IndexError, match="index out of range in aten::index"):
            torch.tpu.synchronize()
    torch.tpu.synchronize()  # raised once
    assert x.sum().item() == 10
    del bad


@pytest.mark.parametrize("fn", [
    lambda x, i: x.index_select(0, i),
    lambda x, i: x.gather(0, i),
    lambda x, i: x.clone().scatter_(0, i, x[:2]),
    lambda x, i: torch.nn.functional.embedding(i, x.view(5, 1)),
    lambda x, i: x.clone().index_put_((i,), torch.zeros(2, device=x.device)),
])
def test_every_indexing_op_checks_bounds(fn):
    x = torch.arange(5.0, device="tpu")
    with pytest.raises(IndexError):
        fn(x, torch.tensor([0, 5], device="tpu")).cpu()
    # in range: fine, no sync needed
    fn(x, torch.tensor([0, 4], device="tpu")).cpu()


def test_debug_mode_raises_at_the_op():
    with torch_tpu.mode("debug"):
        x = torch.arange(5.0, device="tpu")
        with pytest.raises(IndexError, match="aten::index_select"):
            x.index_select(0, torch.tensor([9], device="tpu"))


def test_launch_blocking_env_var():
    r = run_py("""
        import torch, torch_tpu
        assert torch_tpu.get_mode() == "debug"
        print("ok")
    """, TPU_LAUNCH_BLOCKING="1", TORCH_TPU_DEFER_AND_FUSE="0")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_two_cpu_devices():
    if importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
        pytest.skip("the CPU plugin (xla-cpu-pjrt) is not installed")
    r = run_py("""
        import torch, torch_tpu
        torch_tpu.set_fallback("error")
        assert torch.tpu.device_count() == 2
        a = torch.arange(6.0).reshape(2, 3)
        x0 = a.to("tpu:0")
        x1 = a.to("tpu:1")
        assert x1.device == torch.device("tpu:1")
        y1 = (x1 @ x1.t()).relu()
        assert y1.device == torch.device("tpu:1")
        assert torch.equal(y1.cpu(), (a @ a.t()).relu())
        z = x0.to("tpu:1") + x1          # copy between devices
        assert z.device.index == 1 and torch.equal(z.cpu(), 2 * a)
        with torch.tpu.device(1):
            w = torch.ones(2, device="tpu")
            assert w.device.index == 1
            torch.manual_seed(0)
        try:
            x0 + x1
        except RuntimeError as e:
            assert "tpu:0" in str(e) and "tpu:1" in str(e)
        else:
            raise AssertionError("mixing devices must raise")
        print("ok")
    """, TORCH_TPU_CPU_DEVICES="2", TORCH_TPU_PLUGIN="cpu")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@torch_tpu.mode("strict")
def test_metrics_count_compiles_hits_and_transfers():
    torch_tpu.reset_metrics()
    x = torch.randn(7, 3).to("tpu")
    for _ in range(3):
        y = x * 3.25 + 1
    y.cpu()
    m = torch_tpu.metrics()
    assert m["executions"] >= 6
    assert m["cache_hits"] >= 4
    assert m["h2d_transfers"] >= 1 and m["d2h_transfers"] >= 1
    assert m["d2h_bytes"] >= 7 * 3 * 4
    assert "compiles" in m.report() and "CPU fallbacks" in m.report()


def test_fallback_is_counted_warned_once_and_can_be_forbidden():
    torch_tpu.reset_metrics()
    x = torch.randn(4, 3, device="tpu")
    y = torch.randn(4, 3, device="tpu")
    sq = x[:3] + y[:3]
    with torch_tpu.lowerings_disabled("_linalg_det"):  # no other test falls back on it
        with pytest.warns(UserWarning, match="_linalg_det"):
            r = torch.linalg.det(sq)
        torch.testing.assert_close(r.cpu(), torch.linalg.det(sq.cpu()))
        assert r.device.type == "tpu"
        assert any("_linalg_det" in k for k in torch_tpu.metrics()["fallbacks"])
        torch_tpu.set_fallback("error")
        try:
            with pytest.raises(RuntimeError, match="TORCH_TPU_FALLBACK=error"):
                torch.linalg.det(sq)
        finally:
            torch_tpu.set_fallback("warn")
    torch_tpu.reset_metrics()
    torch.linalg.det(sq)  # lowered again outside the block
    assert not torch_tpu.metrics()["fallbacks"]


def test_pytorch_backend_autoload_imports_torch_tpu():
    r = run_py("""
        import sys, torch
        x = torch.ones(2, device="tpu") * 3
        assert "torch_tpu" in sys.modules and x.cpu().tolist() == [3.0, 3.0]
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_import_torch_tpu_before_torch():
    r = run_py("""
        import torch_tpu
        import torch
        assert torch.ones(2, device="tpu").sum().item() == 2
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_disable_lowerings_env_sends_the_op_to_the_cpu():
    r = run_py("""
        import torch, torch_tpu
        x = torch.ones(3, device="tpu")
        y = (x * 2 + 1).cpu()
        assert y.tolist() == [3.0, 3.0, 3.0]
        print(sorted(torch_tpu.metrics()["fallbacks"]))
    """, TORCH_TPU_DISABLE_LOWERINGS="add,foo")
    assert r.returncode == 0, r.stderr
    assert "aten::add" in r.stdout and "aten::mul" not in r.stdout, r.stdout
