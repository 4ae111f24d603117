"""FFTs (_fft_r2c / _fft_c2c / _fft_c2r), complex values (complex, polar,
conj_physical, view_as_real / view_as_complex) and the lazy conj/neg bits,
against PyTorch on the CPU with the CPU fallback forbidden."""

import pytest
import torch

import torch_tpu
from conftest import check_against_cpu


pytestmark = pytest.mark.usefixtures("fallback_error")  # conftest.py: CPU fallback raises


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 31 * len(shape))
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


check = check_against_cpu


# FFT results are sums of many terms: allow float32 noise relative to the
# spectrum's size.
TOL = dict(rtol=1e-5, atol=1e-4)
NORMS = [None, "ortho", "forward"]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"])
def test_fft_1d(name, norm):
    fn = getattr(torch.fft, name)
    real_in = name in ("rfft", "ihfft")
    x = make((3, 4, 10), torch.float32 if real_in else torch.complex64)
    check(lambda t: fn(t, norm=norm), x, **TOL)
    check(lambda t: fn(t, n=7, dim=1, norm=norm), x, **TOL)  # cropped / padded signal
    if not real_in:
        check(lambda t: fn(t, norm=norm), make((3, 8)), **TOL)  # real input promoted


@pytest.mark.parametrize("name", ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"])
def test_fft_2d(name):
    fn = getattr(torch.fft, name)
    x = make((3, 4, 6), torch.float32 if name.startswith(("rfft", "ihfft")) else torch.complex64)
    check(fn, x, **TOL)
    check(lambda t: fn(t, dim=(2, 0), norm="ortho"), x, **TOL)  # the halved dim is the last one listed
    check(lambda t: fn(t, s=(5, 4)), x, **TOL)


@pytest.mark.parametrize("name", ["fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"])
def test_fft_nd_more_than_three_dims(name):
    # stablehlo.fft handles three dims at a time: five go in two groups.
    fn = getattr(torch.fft, name)
    x = make((2, 3, 2, 3, 4), torch.float32 if name.startswith(("rfft", "ihfft")) else torch.complex64)
    check(fn, x, **TOL)
    check(lambda t: fn(t, dim=(0, 2, 1, 4), norm="forward"), x, **TOL)
    if name in ("fftn", "ifftn"):
        check(lambda t: fn(t, dim=()), x)  # no dims: the identity


def test_fft_onesided_false_full_spectrum():
    x = make((2, 6))
    check(lambda t: torch._fft_r2c(t, [1], 0, False), x, **TOL)
    check(lambda t: torch._fft_r2c(t, [0, 1], 2, False), x, **TOL)


def test_stft():
    x = make((2, 64))
    w = torch.hann_window(16)
    check(lambda t, win: torch.stft(t, 16, hop_length=4, window=win, return_complex=True), x, w, **TOL)
    check(lambda t: torch.stft(t, 8, return_complex=True, onesided=False), x, **TOL)


def test_istft_roundtrip_and_equal():
    x, w = make((2, 64)), torch.hann_window(16)
    spec = torch.stft(x, 16, hop_length=4, window=w, return_complex=True)
    check(lambda s, win: torch.istft(s, 16, hop_length=4, window=win), spec, w, **TOL)
    t = torch.tensor([1.0, float("nan")]).to("tpu")
    assert not torch.equal(t, t) and torch.equal(t[:1], t[:1].long()) and not torch.equal(t[:1], t)


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "hfft", "ihfft", "fft2", "rfftn"])
def test_fft_grad(name):
    fn = getattr(torch.fft, name)
    x = make((4, 6), torch.complex64 if name in ("irfft", "hfft") else torch.float32)

    def grad(t):
        t = t.detach().requires_grad_()
        y = fn(t)
        y = torch.view_as_real(y.resolve_conj()) if y.is_complex() else y
        w = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.device)
        (g,) = torch.autograd.grad((y * w).sum(), t)
        return g

    check(grad, x, **TOL)


def test_fft_bad_size():
    for dev in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="Invalid number of data points"):
            torch.fft.irfft(make((4,), torch.complex64).to(dev), n=0)


# ------------------------------------------------------------ complex values


def test_complex_polar_conj_physical():
    check(torch.complex, make((3, 1)), make((4,)))
    check(torch.polar, make((3, 4)).abs(), make((3, 4)))
    c = make((3, 4), torch.complex64)
    check(torch.conj_physical, c)
    check(lambda t: t.clone().conj_physical_(), c)
    check(torch.conj_physical, make((3,)))  # real: the identity


def test_polar_grad():
    a, b = make((5,)).abs(), make((5,), seed=1)
    g = make((5,), torch.complex64, seed=2)

    def grads(x, y, gz):
        x, y = x.detach().requires_grad_(), y.detach().requires_grad_()
        return torch.stack(torch.autograd.grad(torch.polar(x, y), (x, y), gz))

    check(grads, a, b, g)


def test_complex_scalar_constant():
    c = make((3,), torch.complex64)
    check(lambda t: torch.ops.aten.mul.Scalar(t, 2 - 3j), c)
    check(lambda t: torch.ops.aten.add.Scalar(t, 1j), c)


@pytest.mark.parametrize("z", [1j, 2 - 3j])
def test_python_complex_numbers(z):
    # A Python complex arrives as a wrapped complex128 scalar; the device
    # computes in complex64, PyTorch's promotion for float32 and complex.
    x, c = make((4,)), make((4,), torch.complex64)
    for a in (x, c):
        check(lambda t: t * z, a)
        check(lambda t: z - t, a)
        check(lambda t: t / z, a)  # complex division keeps the imaginary part
        check(lambda t: torch.exp(z * t), a)
    check(lambda t, u: t / u, c, make((4,), torch.complex64, seed=3))


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_spectral_pipeline_with_grad(mode):
    # rfft -> phase -> 1j scaling -> irfft, and back: the backward multiplies
    # by conj() of the saved Python complex (a 0-d complex128 CPU tensor).
    def f(x, w):
        spec = torch.fft.rfft(x * w)
        y = torch.fft.irfft(spec * torch.exp(1j * torch.angle(spec)), n=x.shape[-1])
        return y.abs().mean() + torch.view_as_real(spec).sum()

    x, w = make((4, 32)), torch.hann_window(32)

    def value_and_grad(t, win):
        t = t.detach().requires_grad_()
        y = f(t, win)
        (g,) = torch.autograd.grad(y, t)
        return torch.cat([y.reshape(1), g.flatten()])

    with torch_tpu.mode(mode):
        check(value_and_grad, x, w, **TOL)


def test_complex_magnitude_phase_and_reductions():
    # What follows an FFT: |z|, angle, means, norms, equality, vdot.
    c, d = make((3, 5), torch.complex64), make((3, 5), torch.complex64, seed=1)
    check(torch.abs, c)
    check(torch.angle, c)
    check(lambda t: t.mean(1), c)
    check(lambda t: torch.linalg.vector_norm(t, 2, dim=1), c)
    check(lambda t: torch.linalg.vector_norm(t, float("inf")), c)
    check(lambda t: torch.linalg.norm(t), c)
    check(lambda t, u: torch.eq(t, u) | (t != t.conj()), c, d)
    check(lambda t, u: torch.vdot(t[0], u[0]), c, d)
    check(lambda t, u: torch.lerp(t, u, 0.7), c, d)
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([complex(inf, 0), complex(0, -inf), complex(nan, inf), complex(1, 2), complex(1, nan)])
    for f in (torch.isinf, torch.isnan, torch.isfinite):
        check(f, z)


def test_complex_var_std_and_inverse_hyperbolics():
    c = make((4, 5), torch.complex64)
    check(lambda t: torch.var(t, 1), c)
    check(lambda t: torch.std_mean(t, 0, keepdim=True)[0], c)
    check(lambda t: torch.var_mean(t, correction=0)[1], c)  # the mean stays complex
    # Both sides of the branch cuts (re 0 / |re| > 1 / re < 1) and near 0.
    z = torch.tensor([complex(a, b) for a in (-3, -0.5, 0, 1e-3, 0.5, 3) for b in (-2, -0.5, 0, 1e-3, 0.5, 2)])
    for f in (torch.asinh, torch.acosh, torch.atanh):
        check(f, z)


def test_complex_ops_without_a_complex_lowering_fall_back():
    # A clear fallback (an error under TORCH_TPU_FALLBACK=error), not an IR
    # failure or a silently real result.
    c = make((3, 4), torch.complex64).to("tpu")
    for f in (lambda t: torch.logsumexp(t, 0), lambda t: torch.logaddexp(t, t), lambda t: torch.renorm(t, 2, 0, 1.0)):
        with pytest.raises(RuntimeError, match="has no tpu lowering"):
            f(c)


def test_sum_mean_dim_none_keepdim():
    x = make((2, 3, 4))
    check(lambda t: torch.sum(t, dim=None, keepdim=True), x)
    check(lambda t: torch.mean(t, dim=None, keepdim=True, dtype=torch.float64), x)


def test_complex_scalars_only_where_lowerings_promote():
    c = make((3,), torch.complex64)
    check(lambda t: torch.lerp(t, 2 * t, 0.5 + 1j), c)
    check(lambda t: t.masked_fill(t.real > 0, 2j), c)
    check(lambda t: torch.addcdiv(t, t, t + 3, value=1j), c)
    # linspace computes in float: a complex end point runs on the CPU.
    with pytest.raises(RuntimeError, match="complex scalar"):
        torch.linspace(0, 1 + 1j, 5, device="tpu")


def test_view_as_real_complex_share_storage():
    c = make((3, 4), torch.complex64)
    t = c.to("tpu")
    r = torch.view_as_real(t)
    torch.testing.assert_close(r.cpu(), torch.view_as_real(c))
    r[..., 1].mul_(-2)  # writes through to the complex tensor
    ref = c.clone()
    torch.view_as_real(ref)[..., 1].mul_(-2)
    torch.testing.assert_close(t.cpu(), ref)
    back = torch.view_as_complex(r)
    torch.testing.assert_close(back.cpu(), ref)
    # A strided, offset view.
    torch.testing.assert_close(torch.view_as_real(t[1:, ::2]).cpu(), torch.view_as_real(ref[1:, ::2]))
    x = make((5, 2))
    check(lambda u: torch.view_as_complex(u[1:]), x)


def test_view_as_errors_match_cpu():
    for dev in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="last dimension of size 2"):
            torch.view_as_complex(make((3, 3)).to(dev))
        with pytest.raises(RuntimeError, match="unresolved conjugated"):
            torch.view_as_real(make((3,), torch.complex64).to(dev).conj())
    with pytest.raises(TypeError, match="not supported on tpu"):  # complex32: no plugin computes it
        torch.view_as_complex(make((3, 2), torch.float16).to("tpu"))


def test_view_as_real_fused():
    c = make((4,), torch.complex64)
    with torch_tpu.mode("fused"):
        t = c.to("tpu")
        r = torch.view_as_real(t) * 2
        out = r.cpu()
    torch.testing.assert_close(out, torch.view_as_real(c) * 2)


# ------------------------------------------------------------ conj/neg bits


def test_conj_bit_copies():
    c = make((3, 4), torch.complex64)
    t = c.to("tpu")
    torch.testing.assert_close(t.conj().cpu(), c.conj())
    torch.testing.assert_close(t.conj().resolve_conj().cpu(), c.conj())
    torch.testing.assert_close(t.conj().clone().cpu(), c.conj())
    torch.testing.assert_close(t.conj().imag.cpu(), c.conj().imag)  # a neg view
    # Into a conj view: its memory takes the conjugate (cpu -> tpu and tpu -> tpu).
    d = torch.zeros_like(t)
    d.conj().copy_(c)
    torch.testing.assert_close(d.cpu(), c.conj())
    e = torch.zeros_like(t)
    e.conj().copy_(t)
    torch.testing.assert_close(e.cpu(), c.conj())


def test_conj_bit_reaches_lowered_ops():
    # Matrix products see conj views without the Conjugate fallback.
    a, b = make((3, 4), torch.complex64), make((4, 2), torch.complex64, seed=1)
    check(lambda x, y: torch.mm(x.conj(), y), a, b)
    check(lambda x, y: x.mH @ y.conj().T.conj(), a.T.contiguous(), b.T.contiguous())
    check(lambda x, y: torch.cat([x.conj(), y.T]), a, b)
