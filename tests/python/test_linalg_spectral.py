"""SVD, QR, symmetric eigendecomposition and least squares lowered natively
(no CPU fallback), against PyTorch on the CPU with float32 tolerances.
Singular vectors and eigenvectors are compared up to sign."""

import pytest
import torch

import torch_tpu
from conftest import assert_tpu_close

TOL = dict(rtol=1.3e-6, atol=1e-5)


pytestmark = pytest.mark.usefixtures("fallback_error")  # conftest.py: CPU fallback raises


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def close(ref, out, **tol):
    assert_tpu_close(out, ref, **(tol or TOL))


@pytest.mark.parametrize("shape,full", [((5, 3), True), ((5, 3), False), ((3, 5), True), ((2, 4, 4), False)])
def test_svd(shape, full):
    a = rand(*shape)
    u0, s0, vh0 = torch.linalg.svd(a, full_matrices=full)
    u, s, vh = torch.linalg.svd(a.to("tpu"), full_matrices=full)
    assert u.shape == u0.shape and vh.shape == vh0.shape
    k = s0.shape[-1]
    close(s0, s)
    close(u0[..., :k].abs(), u[..., :k].abs())
    close(vh0[..., :k, :].abs(), vh[..., :k, :].abs())
    u, vh = u.cpu(), vh.cpu()
    close_rec = (u[..., :k] * s.cpu().unsqueeze(-2)) @ vh[..., :k, :]
    torch.testing.assert_close(close_rec, a, rtol=1e-5, atol=1e-5)
    if full:  # the completed bases are orthonormal too
        eye = torch.eye(u.shape[-1]).expand_as(u.mT @ u)
        torch.testing.assert_close(u.mT @ u, eye, rtol=0, atol=1e-5)
        eye = torch.eye(vh.shape[-1]).expand_as(vh @ vh.mT)
        torch.testing.assert_close(vh @ vh.mT, eye, rtol=0, atol=1e-5)


def test_svdvals_and_friends():
    a = rand(3, 6, 4, seed=1)
    close(torch.linalg.svdvals(a), torch.linalg.svdvals(a.to("tpu")))
    # A rank-deficient matrix: rank and pseudo-inverse see the zero singular value.
    s = rand(5, 3, seed=2) @ rand(3, 5, seed=3)
    close(torch.linalg.matrix_rank(s), torch.linalg.matrix_rank(s.to("tpu")))
    close(torch.linalg.pinv(s), torch.linalg.pinv(s.to("tpu")), rtol=1e-4, atol=1e-4)


def test_svd_rank_deficient_bases_stay_orthonormal():
    # Zero and noise-level singular values: U still orthonormal, A rebuilt.
    a = torch.stack([torch.zeros(6, 4), rand(6, 2, seed=15) @ rand(2, 4, seed=16)])
    u, s, vh = (x.cpu() for x in torch.linalg.svd(a.to("tpu"), full_matrices=True))
    torch.testing.assert_close(s, torch.linalg.svdvals(a), **TOL)
    torch.testing.assert_close(u.mT @ u, torch.eye(6).expand(2, 6, 6), rtol=0, atol=1e-5)
    torch.testing.assert_close(vh @ vh.mT, torch.eye(4).expand(2, 4, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close((u[..., :4] * s.unsqueeze(-2)) @ vh, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 3, 2)])
def test_svd_empty(shape):
    a = torch.zeros(shape)
    for full in (False, True):
        ref = torch.linalg.svd(a, full_matrices=full)
        out = torch.linalg.svd(a.to("tpu"), full_matrices=full)
        for r, o in zip(ref, out):
            close(r, o)


@pytest.mark.parametrize("shape,mode", [((5, 3), "reduced"), ((5, 3), "complete"), ((3, 5), "reduced"), ((2, 4, 4), "r")])
def test_qr(shape, mode):
    a = rand(*shape, seed=4)
    q0, r0 = torch.linalg.qr(a, mode=mode)
    q, r = torch.linalg.qr(a.to("tpu"), mode=mode)
    # LAPACK's sign convention: Q and R match exactly, not just up to sign.
    close(q0, q)
    close(r0, r)


def test_geqrf_householder_ormqr():
    a = rand(2, 6, 4, seed=5)
    h0, tau0 = torch.geqrf(a)
    h, tau = torch.geqrf(a.to("tpu"))
    close(h0, h)
    close(tau0, tau)
    close(torch.linalg.householder_product(h0, tau0), torch.linalg.householder_product(h, tau))
    c = rand(2, 6, 3, seed=6)
    ct = rand(2, 3, 6, seed=7)
    for left, other in ((True, c), (False, ct)):
        for transpose in (False, True):
            ref = torch.ormqr(h0, tau0, other, left=left, transpose=transpose)
            close(ref, torch.ormqr(h, tau, other.to("tpu"), left=left, transpose=transpose))


@pytest.mark.parametrize("shape,uplo", [((5, 5), "L"), ((2, 4, 4), "U"), ((1, 1), "L")])
def test_eigh(shape, uplo):
    a = rand(*shape, seed=8)  # not symmetric: only the UPLO triangle counts
    w0, v0 = torch.linalg.eigh(a, UPLO=uplo)
    w, v = torch.linalg.eigh(a.to("tpu"), UPLO=uplo)
    close(w0, w)
    close(v0.abs(), v.abs())
    if len(shape) == 3:
        close(w0, torch.linalg.eigvalsh(a.to("tpu"), UPLO=uplo))


def test_eigh_repeated_eigenvalues():
    q, _ = torch.linalg.qr(rand(6, 6, seed=9))
    a = q @ torch.diag(torch.tensor([1.0, 1.0, 1.0, 2.0, -3.0, -3.0])) @ q.T
    w, v = torch.linalg.eigh(a.to("tpu"))
    close(torch.linalg.eigvalsh(a), w)
    v = v.cpu()
    torch.testing.assert_close(v @ torch.diag(w.cpu()) @ v.T, a, rtol=1e-5, atol=1e-5)


# gelsd/gelss with m > n fall back to the CPU: their residuals' shape
# depends on the rank.
@pytest.mark.parametrize("driver,m,n", [("gels", 5, 3), ("gels", 3, 5), ("gelsy", 5, 3), ("gelsd", 3, 5), ("gelss", 4, 4)])
def test_lstsq(driver, m, n):
    a, b = rand(2, m, n, seed=10), rand(2, m, 2, seed=11)
    ref = torch.linalg.lstsq(a, b, driver=driver)
    out = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
    for r, o in zip(ref, out):
        assert r.shape == o.shape and r.dtype == o.dtype
        close(r, o, rtol=1e-4, atol=1e-5)


def test_lstsq_empty():
    for driver in ("gels", "gelsy", "gelsd"):
        for sa, sb in (((3, 0), (3, 2)), ((0, 3), (0, 2)), ((2, 0, 3, 2), (2, 0, 3, 2))):
            a, b = torch.randn(sa), torch.randn(sb)
            ref = torch.linalg.lstsq(a, b, driver=driver)
            out = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
            for r, o in zip(ref, out):
                assert r.shape == o.shape and r.dtype == o.dtype
                close(r, o)


def test_gradients():
    a = rand(4, 3, seed=12)
    at = a.to("tpu").requires_grad_()
    ac = a.clone().requires_grad_()
    for fn in (lambda x: torch.linalg.svdvals(x).sum(), lambda x: torch.linalg.eigvalsh(x @ x.mT).sum()):
        (g0,) = torch.autograd.grad(fn(ac), ac)
        (g,) = torch.autograd.grad(fn(at), at)
        close(g0, g, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise_like_the_cpu():
    for fn in (lambda x: torch.linalg.eigh(x), lambda x: torch.linalg.qr(x, mode="bogus")):
        a = rand(3, 4)
        with pytest.raises(RuntimeError) as ref:
            fn(a)
        with pytest.raises(type(ref.value)):
            fn(a.to("tpu"))
    with pytest.raises(RuntimeError):
        torch.linalg.svd(rand(3).to("tpu"))
    with pytest.raises(RuntimeError, match="driver"):  # cuSOLVER only, as on the CPU
        torch.linalg.svd(rand(3, 3).to("tpu"), driver="gesvd")


def test_matrix_exp():
    a = rand(2, 4, 4, seed=13) * torch.tensor([0.01, 1.0]).view(2, 1, 1)
    close(torch.linalg.matrix_exp(a), torch.linalg.matrix_exp(a.to("tpu")))
    # Large norms (several squarings): against float64, since the CPU's
    # float32 result itself drifts by more than the float32 tolerance there.
    a = rand(3, 5, 5, seed=14) * 8
    ref = torch.linalg.matrix_exp(a.double())
    out = torch.linalg.matrix_exp(a.to("tpu")).cpu().double()
    scale = ref.abs().amax(dim=(-2, -1), keepdim=True)
    assert ((out - ref).abs() / scale).max().item() < 1e-6


def test_float64():
    a = rand(5, 4, seed=17).double()
    s0 = torch.linalg.svdvals(a)
    close(s0, torch.linalg.svdvals(a.to("tpu")), rtol=1e-12, atol=1e-12)
    w0, v0 = torch.linalg.eigh(a[:4])
    w, v = torch.linalg.eigh(a[:4].to("tpu"))
    close(w0, w, rtol=1e-12, atol=1e-12)
    close(v0.abs(), v.abs(), rtol=1e-10, atol=1e-10)
    q0, r0 = torch.linalg.qr(a)
    q, r = torch.linalg.qr(a.to("tpu"))
    close(q0, q, rtol=1e-12, atol=1e-12)
    close(r0, r, rtol=1e-12, atol=1e-12)
