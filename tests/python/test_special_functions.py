"""Orthogonal polynomials, Bessel-family functions, igamma/igammac and frexp
against PyTorch on the CPU, with PyTorch's default tolerances and the CPU
fallback forbidden."""

import math

import pytest
import torch

import torch_tpu
from conftest import assert_tpu_close

S = torch.special
INF, NAN = math.inf, math.nan


pytestmark = pytest.mark.usefixtures("fallback_error")  # conftest.py: CPU fallback raises


def close(out, ref):
    assert_tpu_close(out, ref, equal_nan=True)


POLYS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
    "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
    "laguerre_polynomial_l", "legendre_polynomial_p",
]


def _poly_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.5, 2.0, 1e-30]),
                   torch.linspace(-1.2, 1.2, 25), torch.rand(16, generator=g) * 18 - 9])
    # Fractional degrees truncate; nan/inf/negative degrees give 0; 7..10 use
    # PyTorch's trigonometric forms inside (-1, 1).
    n = torch.tensor([-2.0, -0.5, 0.0, 0.7, 1.0, 2.0, 3.0, 5.0, 7.0, 8.0, 9.0, 10.0, NAN, INF])
    return x[:, None], n[None, :]


@pytest.mark.parametrize("name", POLYS)
def test_orthogonal_polynomial(name):
    f = getattr(S, name)
    x, n = _poly_grid()
    close(f(x.to("tpu"), n.to("tpu")), f(x, n))


@pytest.mark.parametrize("name", ["chebyshev_polynomial_t", "legendre_polynomial_p"])
def test_polynomial_int_and_scalar_overloads(name):
    f = getattr(S, name)
    x, n = _poly_grid()
    # Integer inputs promote to float32; the x_scalar / n_scalar overloads.
    xi, ni = torch.arange(-4, 5).reshape(3, 3), torch.tensor([0, 3, 6])
    close(f(xi.to("tpu"), ni.to("tpu")), f(xi, ni))
    close(f(x.to("tpu"), 4), f(x, 4))
    close(f(0.25, n.to("tpu")), f(0.25, n))


def test_polynomial_huge_degree_stops_early():
    # Values overflow to nan long before the degree: the loop stops there.
    x = torch.tensor([2.0, 3.0, -5.0])
    n = torch.tensor([1e9, 1e9, 2e9])
    close(S.chebyshev_polynomial_t(x.to("tpu"), n.to("tpu")), S.chebyshev_polynomial_t(x, n))


BESSEL = [
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_k0",
    "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
    "spherical_bessel_j0", "airy_ai", "modified_bessel_i0", "modified_bessel_i1",
]


@pytest.mark.parametrize("name", BESSEL)
def test_bessel_family(name):
    f = getattr(S, name)
    x = torch.cat([torch.tensor([0.0, -0.0, 1e-20, 1e-3, -1e-3, 2.0, -2.0, 7.0, -7.0, 12.0,
                                 -12.0, 40.0, -40.0, 250.0, INF, -INF, NAN]),
                   torch.linspace(-30, 30, 463)])
    close(f(x.to("tpu")), f(x))
    if name in ("bessel_y1", "airy_ai"):
        xi = torch.arange(-6, 7)
        close(f(xi.to("tpu")), f(xi))


def test_bessel_family_float64_against_mpmath():
    # PyTorch's own float64 kernels are off by ~1e-7 in places (J0 near
    # x = 5.7, say): the reference here is mpmath.
    mp = pytest.importorskip("mpmath")
    xs = [0.3, 1.7, 5.71, 9.5, 11.9, 12.1, 33.3, 250.0]
    refs = {
        "bessel_j0": lambda v: mp.besselj(0, v), "bessel_y1": lambda v: mp.bessely(1, v),
        "scaled_modified_bessel_k1": lambda v: mp.besselk(1, v) * mp.exp(v),
        "airy_ai": mp.airyai,
    }
    x = torch.tensor(xs + [-v for v in xs[:5]], dtype=torch.float64)
    for name, ref in refs.items():
        if name.startswith(("bessel_y", "modified", "scaled")):
            xx = x[: len(xs)]
        else:
            xx = x
        out = getattr(S, name)(xx.to("tpu")).cpu()
        want = torch.tensor([float(ref(v)) for v in xx.tolist()], dtype=torch.float64)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12, msg=name)


def test_igamma_igammac():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(400, generator=g) * 30
    x = torch.rand(400, generator=g) * 40
    a[:8] = torch.tensor([0.0, 0.0, 1.0, INF, INF, NAN, 2.0, -1.0])
    x[:8] = torch.tensor([0.0, 1.0, 0.0, 1.0, INF, 0.0, INF, 1.0])
    # Large shape parameters near the transition x ~ a.
    a[8:40] = torch.logspace(1, 4, 32)
    x[8:40] = a[8:40] * 1.01
    # Huge ones (Temme's expansion): the CPU's float32 kernel is less exact
    # there than its float64 one, which is their reference.
    a[-6:] = torch.tensor([600.0, 1e5, 1e6, 1e7, 1e7, 3e4])
    x[-6:] = a[-6:] * torch.tensor([0.5, 1.003, 1.0, 1.0, 0.9995, 1.2])
    for f in (torch.igamma, torch.igammac, S.gammainc, S.gammaincc):
        out = f(a.to("tpu"), x.to("tpu"))
        close(out[:-6], f(a[:-6], x[:-6]))
        close(out[-6:], f(a[-6:].double(), x[-6:].double()).float())
    ab, xb = a[:50].bfloat16(), x[:50, None].bfloat16()
    close(torch.igammac(ab.to("tpu"), xb.to("tpu")), torch.igammac(ab, xb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_frexp(dtype):
    vals = [0.0, -0.0, 1.0, -3.0, 0.75, 1e-40, -1e-45, 1e-310, 3e38, INF, -INF, NAN, 6e-5]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    m, e = torch.frexp(x)
    mo, eo = torch.frexp(x.to("tpu"))
    close(mo, m)
    close(eo, e)
    assert torch.equal(torch.signbit(mo.cpu()), torch.signbit(m))


@pytest.mark.filterwarnings("ignore:.*has no tpu lowering")
def test_half_precision_raises_like_cpu():
    # The CPU has no half-precision kernels for these: tpu raises as well.
    torch_tpu.set_fallback("warn")
    x = torch.tensor([1.5], dtype=torch.bfloat16)
    for f in (S.bessel_j0, lambda t: S.chebyshev_polynomial_t(t, t)):
        with pytest.raises(NotImplementedError):
            f(x)
        with pytest.raises(NotImplementedError):
            f(x.to("tpu"))


def test_frexp_rejects_integers():
    x = torch.arange(4)
    with pytest.raises(RuntimeError, match="floating"):
        torch.frexp(x)
    with pytest.raises(RuntimeError, match="floating"):
        torch.frexp(x.to("tpu"))
