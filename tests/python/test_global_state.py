"""Process state that changes what an op returns (issue 2/6, class 1): a program cached under one
value of the state must not serve another, in any mode, compiled graphs included. One test per
piece of state; each runs the op under one value first, so that a cache that ignores the state
would hand back the first program."""

from __future__ import annotations

import contextlib

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the device)

pytestmark = pytest.mark.mode_dependent


@contextlib.contextmanager
def default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def deterministic(on=True):
    old, old_fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
        torch.utils.deterministic.fill_uninitialized_memory = old_fill


CASES = {
    "true_divide of integers": lambda a, b: a / b,
    "sqrt of integers": lambda a, b: a.sqrt(),
    "sin of integers": lambda a, b: torch.sin(b),
    "integer / python float": lambda a, b: a / 2.5,
    "mean after a float cast": lambda a, b: a.float().mean() + torch.true_divide(a, b).sum(),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_dtype_is_part_of_the_signature(case):
    fn = CASES[case]
    a_cpu, b_cpu = torch.tensor([3, 7, 9]), torch.tensor([2, 2, 4])
    a, b = a_cpu.to("tpu"), b_cpu.to("tpu")
    for dt in (torch.float32, torch.float64, torch.float32, torch.float16):
        with default_dtype(dt):
            got, want = fn(a, b), fn(a_cpu, b_cpu)
            assert got.dtype == want.dtype, (dt, got.dtype, want.dtype)
            torch.testing.assert_close(got.cpu(), want)


def test_default_dtype_of_factories():
    for dt in (torch.float32, torch.float64, torch.float32):
        with default_dtype(dt):
            for got, want in ((torch.arange(0, 1, 0.25, device="tpu"), torch.arange(0, 1, 0.25)),
                              (torch.full((3,), 1.5, device="tpu"), torch.full((3,), 1.5)),
                              (torch.linspace(0, 1, 5, device="tpu"), torch.linspace(0, 1, 5)),
                              (torch.ones(2, device="tpu") * 3, torch.ones(2) * 3)):
                assert got.dtype == want.dtype == dt
                torch.testing.assert_close(got.cpu(), want)


def test_default_dtype_in_a_compiled_graph():
    f = torch.compile(lambda a, b: a / b + 1, backend="tpu")
    a, b = torch.tensor([3, 7], device="tpu"), torch.tensor([2, 4], device="tpu")
    for dt in (torch.float32, torch.float64):
        with default_dtype(dt):
            out = f(a, b)
            assert out.dtype == dt
            torch.testing.assert_close(out.cpu(), torch.tensor([2.5, 2.75], dtype=dt))


def test_deterministic_mode_fills_new_memory_as_the_cpu_does():
    torch.empty(4, device="tpu")  # the same allocation outside the mode first
    with deterministic():
        assert torch.empty(4, device="tpu").cpu().isnan().all()
        assert torch.empty(2, 3, device="tpu", dtype=torch.float64).cpu().isnan().all()
        assert (torch.empty(3, device="tpu", dtype=torch.int32).cpu() == torch.iinfo(torch.int32).max).all()
        assert torch.empty_strided((2, 2), (1, 2), device="tpu").cpu().isnan().all()
        t = torch.zeros(2, device="tpu")
        t.resize_(5)  # the grown elements only
        got = t.cpu()
        assert (got[:2] == 0).all() and got[2:].isnan().all()
        torch.utils.deterministic.fill_uninitialized_memory = False
        assert not torch.empty(4, device="tpu").cpu().isnan().any()  # the switch that turns it off
    assert not torch.empty(4, device="tpu").cpu().isnan().any()  # and off again outside the mode


@pytest.mark.mode_dependent
def test_deterministic_fill_of_unsigned_types_keeps_their_maximum():
    # The global-state walk: uint64's maximum is past int64's range, and the fill raised
    # "value cannot be converted to type int64_t without overflow" (hash_tensor's output).
    with deterministic():
        for dt in (torch.uint64, torch.uint32, torch.uint16, torch.uint8):
            got = torch.empty(3, dtype=dt, device="tpu").cpu()
            assert got.tolist() == torch.empty(3, dtype=dt).tolist(), dt
        x = torch.randn(4, 5)
        assert torch.equal(torch.hash_tensor(x.to("tpu")).cpu(), torch.hash_tensor(x))


def test_autocast_state():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ta, tb = a.to("tpu"), b.to("tpu")
    assert (ta @ tb).dtype == torch.float32
    for _ in range(2):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            got = ta @ tb
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = a @ b
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu(), want)
        assert (ta @ tb).dtype == torch.float32


def test_grad_mode_in_a_compiled_function():
    f = torch.compile(lambda x: (x * x).sum(), backend="tpu")
    x = torch.arange(3.0, device="tpu", requires_grad=True)
    with torch.no_grad():
        assert not f(x).requires_grad
    y = f(x)
    y.backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * torch.arange(3.0))
