"""Unary float math on complex inputs (ops/common.cpp's floatUnary, shared by the
elementwise and special-function lowerings): what PyTorch's CPU kernels compute
is computed on tpu, natively, and what they refuse raises PyTorch's own error
before any lowering, in every mode. The special functions' copy used to refuse
complex in the lowering, so complex sinc, which the CPU computes, went to the
CPU fallback (and raised under TORCH_TPU_FALLBACK=error)."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

MODES = ["strict", "fused"]

# Served by floatUnary; PyTorch's CPU kernels compute them on complex input.
COMPUTED = ["sinc", "exp", "log", "sqrt", "sin", "tanh", "sigmoid", "reciprocal", "asinh", "acosh", "atanh"]
# Served by floatUnary; PyTorch's CPU kernels refuse complex input.
REFUSED = ["lgamma", "digamma", "erfinv", "i0", "special.i0e", "special.i1", "special.i1e", "special.ndtri",
           "special.erfcx", "special.log_ndtr", "special.entr", "deg2rad", "rad2deg", "erf"]


def _op(name: str):
    f = torch
    for part in name.split("."):
        f = getattr(f, part)
    return f


def _complex_input(name: str = "") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g))
    if name == "sinc":
        z[0, 0] = 0  # its removable singularity
    return z


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", COMPUTED)
def test_complex_unary_math_the_cpu_computes_runs_natively(name, mode, fallback_error):
    f, z = _op(name), _complex_input(name)
    with torch_tpu.mode(mode):
        got = f(z.to("tpu")).cpu()
    torch.testing.assert_close(got, f(z), rtol=1e-4, atol=1e-5)
    assert not torch_tpu.metrics()["fallbacks"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", REFUSED)
def test_complex_unary_math_the_cpu_refuses_raises_its_error(name, mode, fallback_error):
    f, z = _op(name), _complex_input()
    with pytest.raises(Exception) as want:
        f(z)
    with pytest.raises(type(want.value)) as got:
        with torch_tpu.mode(mode):
            f(z.to("tpu")).cpu()
    assert str(got.value) == str(want.value)
    assert not torch_tpu.metrics()["fallbacks"]


@pytest.mark.parametrize("name", ["sinc", "lgamma", "special.entr", "deg2rad"])
def test_real_and_integer_inputs_promote_as_on_the_cpu(name, fallback_error):
    f = _op(name)
    for x in (torch.linspace(-3, 3, 13), torch.arange(-3, 4)):
        got = f(x.to("tpu")).cpu()
        want = f(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.float32, torch.bfloat16])
def test_logit_with_eps_clamps_in_the_result_type(dtype, fallback_error):
    # Found by the global-state walk: an integer input's bounds were cast to the integer type
    # (0.1 and 0.9 both 0), so every element was -inf.
    x = torch.tensor([-2, 0, 1, 3]).to(dtype) if dtype != torch.bool else torch.tensor([True, False])
    for eps in (0.1, 1e-3):
        want = torch.logit(x, eps)
        got = torch.logit(x.to("tpu"), eps).cpu()
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
