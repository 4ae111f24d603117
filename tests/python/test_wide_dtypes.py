"""dtypes the plugin computes (issue 2/6, class 8): complex128 and uint16 were refused with a
TypeError on every plugin; the supported set now comes from the plugin's compiler (one probe
program per dtype), so on the CPU and CUDA plugins they compute as the CPU does, and a plugin
that refuses them (a TPU: float64, complex128) keeps the clear refusal naming the platform."""

from __future__ import annotations

import pytest
import torch

import torch_tpu
from conftest import check_against_cpu

pytestmark = pytest.mark.mode_dependent


def computes(dtype) -> bool:
    try:
        torch.empty(1, dtype=dtype, device="tpu")
    except TypeError as e:
        assert "not supported on tpu" in str(e) and torch_tpu._C._platform() in str(e), e
        return False
    return True


@pytest.fixture
def c128():
    if not computes(torch.complex128):
        pytest.skip(f"the {torch_tpu._C._platform()} plugin does not compute complex128")
    return torch.complex128


def z(*shape, dtype=torch.complex128):
    g = torch.Generator().manual_seed(sum(shape))
    return torch.complex(torch.randn(*shape, generator=g, dtype=torch.float64),
                         torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def test_the_cpu_plugin_computes_them():
    if torch_tpu._C._platform() != "cpu":
        pytest.skip("the CPU plugin's set")
    for dt in (torch.float64, torch.complex128, torch.uint16, torch.uint32, torch.uint64):
        assert computes(dt), dt
    with pytest.raises(TypeError, match="ComplexHalf is not supported on tpu"):
        torch.empty(2, dtype=torch.complex32, device="tpu")


COMPLEX_OPS = {
    "round trip": lambda a, b: a,
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "matmul": lambda a, b: a @ b,
    "abs": lambda a, b: a.abs(),
    "angle": lambda a, b: a.angle(),
    "real/imag": lambda a, b: (a.real * 2, a.imag + 1),
    "conj": lambda a, b: (a.conj() * b).resolve_conj(),
    "exp": lambda a, b: a.exp(),
    "log": lambda a, b: a.log(),
    "sqrt": lambda a, b: a.sqrt(),
    "sum": lambda a, b: a.sum(dim=0),
    "mean": lambda a, b: a.mean(),
    "view_as_real": lambda a, b: torch.view_as_real(a),
    "fft": lambda a, b: torch.fft.fft(a),
    "ifft2": lambda a, b: torch.fft.ifft2(a),
    "with a python complex": lambda a, b: a * (2 - 1j),
    "promotes float64 and complex64": lambda a, b: a.to(torch.complex64) + b.real,
    "cat": lambda a, b: torch.cat([a, b]),
    "index": lambda a, b: a[torch.tensor([2, 0])],
    "where": lambda a, b: torch.where(a.real > 0, a, b),
}


@pytest.mark.parametrize("name", sorted(COMPLEX_OPS))
def test_complex128_matches_the_cpu(name, c128):
    check_against_cpu(COMPLEX_OPS[name], z(4, 4), z(4, 4))


def test_complex128_keeps_float64_precision(c128):
    a = torch.tensor([1 + 1e-12j, 1e-10 + 1j], dtype=c128)
    out = (a.to("tpu") * 3).cpu()
    assert out.dtype == c128
    torch.testing.assert_close(out, a * 3, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["mul", "add", "fill_", "full", "where"])
def test_a_python_complex_keeps_float64_precision(how, c128):
    # A Python complex was a complex64 constant of the program: 1/3 lost its digits past float32.
    s = 1 / 3 + 1e-12j
    ops = {"mul": lambda d: torch.ones(3, dtype=c128, device=d) * s,
           "add": lambda d: torch.ones(3, dtype=c128, device=d) + s,
           "fill_": lambda d: torch.ones(3, dtype=c128, device=d).fill_(s),
           "full": lambda d: torch.full((3,), s, dtype=c128, device=d),
           "where": lambda d: torch.where(torch.ones(3, dtype=torch.bool, device=d), s,
                                          torch.ones(3, dtype=c128, device=d))}
    torch.testing.assert_close(ops[how]("tpu").cpu(), ops[how]("cpu"), rtol=0, atol=0)


def test_view_as_complex_of_float64(c128):
    x = torch.randn(3, 2, dtype=torch.float64)
    check_against_cpu(torch.view_as_complex, x)


def test_rfft_of_float64_and_back(c128):
    x = torch.randn(8, dtype=torch.float64)
    check_against_cpu(lambda t: torch.fft.irfft(torch.fft.rfft(t), n=8), x)


UINT16_OPS = {
    "round trip": lambda a: a,
    "eq": lambda a: a == 7,
    "sort": lambda a: torch.sort(a),
    "mul": lambda a: a * a,
    "sum": lambda a: a.sum(),
    "bitwise_and": lambda a: a & 3,
    "to int32": lambda a: a.to(torch.int32),
    "from int32": lambda a: a.to(torch.int32).to(torch.uint16),
    "index": lambda a: a[1:3],
    "cat": lambda a: torch.cat([a, a]),
    "zeros_like": lambda a: torch.zeros_like(a),
    "fill": lambda a: a.clone().fill_(65535),
}


@pytest.mark.parametrize("name", sorted(UINT16_OPS))
def test_uint16_matches_the_cpu(name):
    if not computes(torch.uint16):
        pytest.skip("the plugin does not compute uint16")
    check_against_cpu(UINT16_OPS[name], torch.tensor([0, 7, 300, 65535, 12], dtype=torch.uint16))


def test_uint16_refuses_what_the_cpu_refuses():
    # uint16 is one of PyTorch's "barebones" unsigned types: the CPU has kernels for a few ops
    # only, and the refusal table (tools/dtype_rejections.py) holds the rest.
    if not computes(torch.uint16):
        pytest.skip("the plugin does not compute uint16")
    a = torch.tensor([1, 2], dtype=torch.uint16)
    for fn in (lambda t: t + 1, lambda t: t.abs(), lambda t: t < t, lambda t: t.max(), lambda t: t.flip(0)):
        for dev in ("cpu", "tpu"):
            with pytest.raises(NotImplementedError, match="UInt16"):
                out = fn(a.to(dev))
                out.cpu()


@pytest.mark.parametrize("other", [torch.int16, torch.uint8, torch.int32, torch.uint32])
def test_uint16_promotes_with_other_integers_as_the_cpu_refuses(other):
    # PyTorch's Python meta kernels promote these; c10's promotion, which its kernels use, refuses.
    if not computes(torch.uint16):
        pytest.skip("the plugin does not compute uint16")
    for fn in (lambda d: torch.ones(3, dtype=torch.uint16, device=d) + torch.ones(3, dtype=other, device=d),
               lambda d: torch.cat([torch.ones(3, dtype=torch.uint16, device=d), torch.ones(3, dtype=other, device=d)])):
        for dev in ("cpu", "tpu"):
            with pytest.raises(RuntimeError, match="Promotion for uint16, uint32, uint64 types is not supported"):
                fn(dev)
    # float promotion is allowed
    check_against_cpu(lambda a: a + torch.ones(2, device=a.device), torch.tensor([1, 2], dtype=torch.uint16))
