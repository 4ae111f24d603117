"""The Cholesky and LU families of torch.linalg against PyTorch on the CPU, with
the CPU fallback forbidden: factors, pivots and info values, solves, inverses,
determinants, their gradients, and the errors raised for singular and
non-positive-definite inputs."""

import pytest
import torch

import torch_tpu
from conftest import assert_tpu_close, check_against_cpu

pytestmark = pytest.mark.usefixtures("fallback_error")  # conftest.py: CPU fallback raises


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def well_conditioned(*shape, dtype=torch.float32, seed=0):
    n = shape[-1]
    return rand(*shape, dtype=dtype, seed=seed) + 3 * torch.eye(n, dtype=dtype)


def spd(*shape, dtype=torch.float32, seed=0):
    a = rand(*shape, dtype=dtype, seed=seed)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def tpu(x):
    return x.to("tpu")


def compare(ref, out, **tol):
    assert_tpu_close(out, ref, **tol)


check = check_against_cpu


# ------------------------------------------------------------------ Cholesky


@pytest.mark.parametrize("dtype,upper", [(torch.float32, False), (torch.float64, True)])
def test_cholesky_ex(dtype, upper):
    check(lambda a: torch.linalg.cholesky_ex(a, upper=upper), spd(2, 3, 5, 5, dtype=dtype))


def test_cholesky_reads_one_triangle():
    a = spd(4, 4)
    a_lower_only = a.tril() + 7 * torch.ones(4, 4).triu(1)
    check(torch.linalg.cholesky, a_lower_only)
    check(lambda x: torch.linalg.cholesky(x, upper=True), a.triu() - 5 * torch.ones(4, 4).tril(-1))


def test_cholesky_info_not_positive_definite():
    a = spd(3, 4, 4)
    a[1, 2, 2] = -50.0  # the leading minor of order 3 fails
    a[2] = torch.zeros(4, 4)  # order 1
    for upper in (False, True):
        ref = torch.linalg.cholesky_ex(a, upper=upper).info
        out = torch.linalg.cholesky_ex(tpu(a), upper=upper).info
        assert ref.tolist() == [0, 3, 1]
        assert out.cpu().tolist() == ref.tolist()


def test_cholesky_raises_like_cpu():
    a = spd(2, 4, 4)
    a[1, 1, 1] = -10.0
    with pytest.raises(torch.linalg.LinAlgError) as cpu_err:
        torch.linalg.cholesky(a)
    with pytest.raises(torch.linalg.LinAlgError) as tpu_err:
        torch.linalg.cholesky(tpu(a))
    assert str(tpu_err.value) == str(cpu_err.value)


def test_old_cholesky():
    check(lambda a: torch.cholesky(a), spd(3, 3))
    check(lambda a: torch.cholesky(a, upper=True), spd(2, 3, 3))


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_solve_and_inverse(upper):
    f = torch.linalg.cholesky(spd(2, 4, 4), upper=upper)
    check(lambda b, l: torch.cholesky_solve(b, l, upper=upper), rand(3, 1, 4, 2, seed=1), f)
    check(lambda l: torch.cholesky_inverse(l, upper=upper), f)


@pytest.mark.parametrize("left,upper,unit", [(True, True, False), (False, False, True), (True, False, True)])
def test_solve_triangular(left, upper, unit):
    a = well_conditioned(2, 1, 4, 4)  # the other triangle must be ignored
    b = rand(3, 4, 2, seed=1) if left else rand(3, 2, 4, seed=1)
    check(lambda x, y: torch.linalg.solve_triangular(x, y, upper=upper, left=left, unitriangular=unit), a, b)


@pytest.mark.parametrize("transpose", [False, True])
def test_triangular_solve(transpose):
    check(lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=transpose), rand(2, 4, 3, seed=1),
          well_conditioned(4, 4))


# ------------------------------------------------------------------ LU


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (2, 3, 6, 6)), (torch.float32, (5, 3)), (torch.float32, (2, 3, 5)), (torch.float64, (4, 4))],
)
def test_lu_factor_matches_lapack_pivots(dtype, shape):
    a = rand(*shape, dtype=dtype)
    ref, out = torch.linalg.lu_factor_ex(a), torch.linalg.lu_factor_ex(tpu(a))
    assert torch.equal(out.pivots.cpu(), ref.pivots)
    assert torch.equal(out.info.cpu(), ref.info)
    compare(ref.LU, out.LU)


def test_lu_info_zero_pivot():
    a = torch.randint(-3, 4, (3, 4, 4), generator=torch.Generator().manual_seed(0)).float()
    a[0, :, 1] = 2 * a[0, :, 0]  # second pivot is exactly zero
    a[1, :, 0] = 0  # first column zero
    a[2] = torch.tensor([[1.0, 2, 3, 4], [2, 4, 6, 8], [1, 0, 1, 0], [0, 1, 0, 1]])
    ref, out = torch.linalg.lu_factor_ex(a), torch.linalg.lu_factor_ex(tpu(a))
    assert ref.info.tolist()[:2] == [2, 1]
    assert out.info.cpu().tolist() == ref.info.tolist()
    assert torch.equal(out.pivots.cpu(), ref.pivots)


@pytest.mark.parametrize("shape", [(4, 4), (2, 6, 3), (2, 3, 6)])
def test_lu_and_unpack(shape):
    a = rand(*shape)
    check(torch.linalg.lu, a)
    LU, piv = torch.linalg.lu_factor(a)
    check(torch.lu_unpack, LU, piv)
    check(lambda x, p: torch.lu_unpack(x, p, unpack_data=False)[0], LU, piv)
    check(lambda x, p: torch.lu_unpack(x, p, unpack_pivots=False)[1:], LU, piv)


@pytest.mark.parametrize("left,adjoint", [(True, False), (True, True), (False, True)])
def test_lu_solve(left, adjoint):
    LU, piv = torch.linalg.lu_factor(well_conditioned(2, 1, 4, 4))
    b = rand(3, 4, 2, seed=1) if left else rand(3, 2, 4, seed=1)
    check(lambda x, p, y: torch.linalg.lu_solve(x, p, y, left=left, adjoint=adjoint), LU, piv, b)


def test_solve():
    dtype = torch.float32
    a = well_conditioned(3, 5, 5, dtype=dtype)
    check(torch.linalg.solve, a, rand(3, 5, 2, dtype=dtype, seed=1))
    check(torch.linalg.solve, a, rand(3, 5, dtype=dtype, seed=1))  # vector rhs
    check(torch.linalg.solve, a[0], rand(4, 5, 1, dtype=dtype, seed=1))  # broadcast A
    check(lambda x, y: torch.linalg.solve(x, y, left=False), a, rand(3, 2, 5, dtype=dtype, seed=1))
    check(torch.linalg.solve_ex, a, rand(3, 5, 2, dtype=dtype, seed=1))


def test_float64():
    a = rand(2, 4, 4, dtype=torch.float64)
    check(torch.linalg.det, a)
    check(torch.linalg.solve, a, rand(2, 4, 2, dtype=torch.float64, seed=1))


def test_inv_det_slogdet():
    dtype = torch.float32
    a = rand(2, 3, 4, 4, dtype=dtype)
    check(torch.linalg.inv_ex, a)
    check(torch.linalg.det, a)
    check(torch.linalg.slogdet, a)
    check(torch.logdet, spd(3, 3, dtype=dtype))
    check(lambda x: torch.linalg.matrix_power(x, -2), well_conditioned(3, 3, dtype=dtype))


def test_singular():
    s = torch.tensor([[1.0, 2, 3], [2, 4, 6], [1, 0, 1]])
    zero_row = rand(3, 3)
    zero_row[1] = 0
    for m in (s, zero_row, s.mT.contiguous()):
        assert torch.linalg.det(tpu(m)).item() == 0
        sign, logabs = torch.linalg.slogdet(tpu(m))
        assert sign.item() == 0 and logabs.item() == float("-inf")
        info = torch.linalg.inv_ex(tpu(m)).info.item()
        assert info > 0
        # The CPU's LAPACK may round an exactly zero pivot to a tiny one (MKL on an
        # AVX-512 machine does for s.mT): its answer is the reference only where it
        # found the zero pivot too.
        cpu_found = torch.linalg.inv_ex(m).info.item() > 0
        if cpu_found:
            assert info == torch.linalg.inv_ex(m).info.item()
        for fn in (torch.linalg.inv, lambda x: torch.linalg.solve(x, torch.ones(3, device=x.device))):
            with pytest.raises(torch.linalg.LinAlgError) as tpu_err:
                fn(tpu(m))
            if cpu_found:
                with pytest.raises(torch.linalg.LinAlgError) as cpu_err:
                    fn(m)
                assert str(tpu_err.value) == str(cpu_err.value)
            else:
                assert "singular" in str(tpu_err.value)


def test_empty():
    check(torch.linalg.inv_ex, torch.zeros(0, 0))
    check(torch.linalg.cholesky_ex, torch.zeros(2, 0, 0))
    check(torch.linalg.det, torch.zeros(2, 0, 0))
    check(torch.linalg.slogdet, torch.zeros(0, 0))
    check(torch.linalg.lu_factor_ex, torch.zeros(2, 0, 3))
    check(torch.linalg.solve, torch.zeros(0, 0), torch.zeros(0, 2))


def grads(fn, *args, dev):
    xs = [a.to(dev).detach().requires_grad_() for a in args]
    out = fn(*xs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    sum(o.sum() for o in outs if o.is_floating_point()).backward()
    return [x.grad.cpu() for x in xs]


@pytest.mark.parametrize(
    "fn,make",
    [
        (torch.linalg.det, lambda: (rand(2, 4, 4),)),
        (lambda a: torch.linalg.det(a.mT), lambda: (rand(2, 4, 4),)),  # a non-contiguous input
        (lambda a: torch.linalg.slogdet(a)[1], lambda: (rand(4, 4),)),
        (lambda a: torch.linalg.slogdet(a.mT)[1], lambda: (rand(4, 4),)),
        (torch.linalg.solve, lambda: (well_conditioned(2, 4, 4), rand(2, 4, 3, seed=1))),
        (lambda a, b: torch.linalg.solve(a.mT, b), lambda: (well_conditioned(2, 4, 4), rand(2, 4, 3, seed=1))),
        (torch.linalg.inv, lambda: (well_conditioned(4, 4),)),
        (lambda a: torch.linalg.lu_factor(a)[0], lambda: (rand(5, 5),)),
        (lambda a: torch.linalg.lu(a)[1:], lambda: (rand(5, 3),)),
        (torch.linalg.cholesky, lambda: (spd(4, 4),)),
        (lambda a: torch.linalg.solve_triangular(a, torch.ones(4, 2, device=a.device), upper=True),
         lambda: (well_conditioned(4, 4),)),
    ],
)
def test_grads(fn, make):
    args = make()
    compare(grads(fn, *args, dev="cpu"), [tpu(g) for g in grads(fn, *args, dev="tpu")], atol=1e-4, rtol=1e-4)
