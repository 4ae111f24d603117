"""Every natively lowered op family against PyTorch on the CPU, over its dtypes,
with PyTorch's default tolerances, and with the CPU fallback forbidden."""

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from conftest import assert_tpu_close

# Both modes in the gate; CPU fallback an error (conftest.py).
pytestmark = [pytest.mark.mode_dependent, pytest.mark.usefixtures("fallback_error")]

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.int64, torch.int32]
ALL = FLOATS + INTS + [torch.bool]


def make(shape, dtype, low=-3, high=3, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape) * 7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
    return torch.randint(low, high + 1, shape, generator=g, dtype=dtype)


def run_both(fn, *args, **kw):
    ref = fn(*args, **kw)
    dev = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*dev, **kw)
    return ref, out


def compare(ref, out, **tol):
    assert_tpu_close(out, ref, **tol)


def check(fn, *args, **tol):
    torch.manual_seed(0)
    ref, out = run_both(fn, *args)
    compare(ref, out, **tol)


UNARY_FLOAT = {
    "exp": torch.exp, "expm1": torch.expm1, "log": lambda x: torch.log(x.abs() + 0.5),
    "log2": lambda x: torch.log2(x.abs() + 0.5), "log10": lambda x: torch.log10(x.abs() + 0.5),
    "log1p": lambda x: torch.log1p(x.abs()), "sqrt": lambda x: torch.sqrt(x.abs()),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1), "sin": torch.sin, "cos": torch.cos, "tan": lambda x: torch.tan(x / 3),
    "tanh": torch.tanh, "sinh": torch.sinh, "cosh": torch.cosh, "asin": lambda x: torch.asin(x / 4),
    "acos": lambda x: torch.acos(x / 4), "atan": torch.atan, "asinh": torch.asinh,
    "acosh": lambda x: torch.acosh(x.abs() + 1), "atanh": lambda x: torch.atanh(x / 4),
    "sigmoid": torch.sigmoid, "erf": torch.erf, "erfc": torch.erfc, "reciprocal": lambda x: torch.reciprocal(x.abs() + 0.5),
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
    "softplus": F.softplus, "elu": F.elu, "selu": F.selu, "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
    "logsigmoid": F.logsigmoid, "relu6": F.relu6, "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "hardtanh": F.hardtanh, "exp2": torch.exp2,
}
UNARY_SAME = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "trunc": torch.trunc, "frac": torch.frac, "relu": torch.relu, "square": torch.square,
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_FLOAT))
def test_unary_float(name, dtype):
    check(UNARY_FLOAT[name], make((4, 7), dtype))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_SAME))
def test_unary_same(name, dtype):
    if name in ("frac", "round", "trunc", "floor", "ceil") and not dtype.is_floating_point:
        pytest.skip("float-only on the CPU too")
    check(UNARY_SAME[name], make((4, 7), dtype))


BINARY = {
    "add": lambda a, b: a + b, "add_alpha": lambda a, b: torch.add(a, b, alpha=2), "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b, "div": lambda a, b: a / (b.abs() + 1), "maximum": torch.maximum,
    "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "where": lambda a, b: torch.where(a > b, a, b),
}


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(name, dtype):
    check(BINARY[name], make((3, 1, 5), dtype), make((4, 5), dtype, seed=1))


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integer_division_modes(dtype):
    a, b = make((6, 5), dtype, -20, 20), make((6, 5), dtype, 1, 6, seed=2)
    for mode in ("floor", "trunc"):
        check(lambda x, y: torch.div(x, y, rounding_mode=mode), a, b)
        check(lambda x, y: torch.div(x, -y, rounding_mode=mode), a, b)
    check(torch.remainder, a, b)
    check(torch.fmod, a, b)
    check(lambda x, y: x // y, a, b)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_float_division_modes(dtype):
    a, b = make((6, 5), dtype, -20, 20), make((6, 5), dtype, 1, 6, seed=2)
    for mode in ("floor", "trunc"):
        check(lambda x, y: torch.div(x, y, rounding_mode=mode), a, b)
    check(torch.remainder, a, b)
    check(torch.fmod, a, b)
    check(torch.pow, a.abs(), b / 3)
    check(torch.atan2, a, b)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_pow_scalar_exponents(dtype):
    # 2, 3, 0.5, -0.5, -1, -2 have their own formulas (the exponent is a program
    # constant); the rest use power(). A new exponent must not reuse the old program.
    x = make((7, 9), dtype, -4, 4)
    pos = x.abs() + 1
    for e in (2, 3, 2.0, 0.5, -0.5, -1, -2, -1.0, 1.5, 1, 0, 4, 0.0):
        base = pos if (isinstance(e, float) and e != int(e)) or e < 0 else x
        if e < 0 and not dtype.is_floating_point:
            base = base.float()
        check(lambda t: torch.pow(t, e), base)
        check(lambda t: t ** e, base)
    check(lambda t: t.clone().pow_(2), x)
    check(lambda t: torch.pow(t, 2.5), pos)  # int base, float exponent: float result


def test_pow_negative_int_exponent_of_int_tensor_raises():
    x = torch.arange(1, 5, device="tpu")
    with pytest.raises(RuntimeError, match="negative integer powers"):
        torch.pow(x, -1)


def test_type_promotion_with_scalars_and_0d():
    i = make((3, 4), torch.int64)
    f = make((3, 4), torch.float32)
    h = make((3, 4), torch.bfloat16)
    check(lambda x: x + 1.5, i)
    check(lambda x: x * 2, h)
    check(lambda x: x + torch.tensor(2.5, dtype=torch.float64), f)  # 0-d cpu tensor joins as a scalar
    check(lambda x, y: x + y, i, f)
    check(lambda x, y: x * y, h, f)
    check(lambda x: x > 0.5, i)
    check(lambda x: x / 2, i)
    b = make((3, 4), torch.bool)
    check(lambda x, y: x & y, b, make((3, 4), torch.bool, seed=3))
    check(lambda x: ~x, b)
    check(lambda x: x.logical_not(), b)


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool], ids=str)
def test_reductions(dtype):
    x = make((4, 5, 6), dtype)
    check(lambda t: t.sum(), x)
    check(lambda t: t.sum(1), x)
    check(lambda t: t.sum((0, 2), keepdim=True), x)
    check(lambda t: t.amax(1), x)
    check(lambda t: t.amin((0, 1)), x)
    check(lambda t: t.any(1), x)
    check(lambda t: t.all(), x)
    if dtype != torch.bool:
        check(lambda t: t.max(2), x)
        check(lambda t: t.min(0, keepdim=True), x)
        check(lambda t: t.argmax(), x)
        check(lambda t: t.argmin(1), x)
        check(lambda t: t.prod(1), x, **({"rtol": 4e-3, "atol": 1e-2} if dtype == torch.float16 else {}))
        check(lambda t: t.cumsum(2), x)
    if dtype.is_floating_point:
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype in (torch.bfloat16, torch.float16) else {}
        check(lambda t: t.mean(), x, **tol)
        check(lambda t: t.mean((1, 2)), x, **tol)
        check(lambda t: t.var(1), x, **tol)
        check(lambda t: t.std((0, 2), correction=0), x, **tol)
        check(lambda t: t.norm(), x, **tol)
        check(lambda t: torch.linalg.vector_norm(t, 1, dim=1), x, **tol)
        check(lambda t: t.logsumexp(1), x, **tol)
        check(lambda t: torch.softmax(t, -1), x, **tol)
        check(lambda t: torch.log_softmax(t, 1), x, **tol)


SPLIT_SUMS = [((5, 512), (-1,)), ((7, 96), (-1,)), ((3, 4096), (-1,)), ((2, 768), (1,)), ((6, 48), (1,)),
              ((8, 64, 4), (0, 1, 2)), ((4, 3, 64), (0, 2)), ((3, 8, 16), (1, 2)), ((6, 40), (-1,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                                   torch.bool], ids=str)
def test_sums_over_the_minor_dim_at_split_widths(dtype):
    # On the CPU plugin a sum over the last dim with a width that is a multiple
    # of 16 runs as [groups, lanes] partial sums (ir::Builder::reduce); the
    # values must be those of a single sum. Floats are checked against float64
    # sums (the CPU's float32 order is one more rounding, not the truth).
    tol = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}.get(dtype, {})
    for shape, dims in SPLIT_SUMS:
        x = make(shape, dtype)
        out = x.to("tpu").sum(dims)
        want = x.double().sum(dims).to(out.dtype) if dtype.is_floating_point else x.sum(dims)
        torch.testing.assert_close(out.cpu(), want, **tol, msg=lambda m, s=shape, d=dims: f"sum{d} of {s}: {m}")


@pytest.mark.parametrize("width", [96, 512, 4096])
def test_row_reductions_built_on_split_sums(width):
    x = make((6, width), torch.float32)
    t = torch.randint(0, width, (6,), generator=torch.Generator().manual_seed(1))
    tol = {"rtol": 1e-5, "atol": 1e-5}
    check(lambda a: a.mean(-1), x, **tol)
    check(lambda a: a.var(-1), x, **tol)
    check(lambda a: torch.linalg.vector_norm(a, dim=-1), x, **tol)
    check(lambda a: torch.softmax(a, -1), x, **tol)
    check(lambda a: torch.log_softmax(a, -1), x, **tol)
    check(lambda a, b: F.cross_entropy(a, b), x, t, **tol)
    check(lambda a: F.rms_norm(a, (width,)), x, **tol)


def test_nan_propagation():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, 6.0]])
    check(lambda t: t.max(1), x, equal_nan=True)
    check(lambda t: t.amax(1), x, equal_nan=True)
    check(lambda t: t.argmax(1), x)
    check(lambda t: torch.maximum(t, t.flip(1)), x, equal_nan=True)
    check(lambda t: t.clamp(2, 5), x, equal_nan=True)
    check(lambda t: t.sort(1), x, equal_nan=True)
    # One-pass NaN-propagating max/min: NaN in any position of long rows (the
    # plugin splits them into windows), over either dim and over all of them.
    big = torch.randn(8, 300, dtype=torch.float64).float()
    big[1, 0] = big[2, 299] = big[3, 150] = big[5, 31] = float("nan")
    big[6] = float("-inf")
    big[7, 40] = float("inf")
    for f in (lambda t: t.amax(1), lambda t: t.amin(1), lambda t: t.amax(0), lambda t: t.amin(0),
              lambda t: t.max(), lambda t: t.min(), lambda t: t.max(1).values, lambda t: t.min(0).values,
              lambda t: t[6:].amax(), lambda t: t.to(torch.bfloat16).amax(1)):
        check(f, big, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32],
                         ids=str)
def test_matmul_family(dtype):
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype in (torch.bfloat16, torch.float16) else {}
    a, b = make((4, 6), dtype), make((6, 3), dtype, seed=1)
    check(torch.mm, a, b, **tol)
    check(lambda x, y: x @ y, a, b[:, 0], **tol)
    check(torch.bmm, make((2, 4, 6), dtype), make((2, 6, 5), dtype, seed=1), **tol)
    check(lambda x, y: x @ y, make((3, 1, 4, 6), dtype), make((2, 6, 5), dtype, seed=1), **tol)
    if dtype.is_floating_point:
        check(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2), make((3,), dtype, seed=3), a, b, **tol)
        check(lambda c, x, y: torch.baddbmm(c, x, y), make((2, 4, 5), dtype, seed=3), make((2, 4, 6), dtype),
              make((2, 6, 5), dtype, seed=1), **tol)
        check(F.linear, make((5, 6), dtype), make((3, 6), dtype, seed=1), make((3,), dtype, seed=2), **tol)


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_shape_ops(dtype):
    x, y = make((3, 4), dtype), make((2, 4), dtype, seed=1)
    check(lambda a, b: torch.cat([a, b]), x, y)
    check(lambda a, b: torch.stack([a, a]), x, y)
    check(lambda a: a.flip(1), x)
    check(lambda a: a.roll(1, 0), x)
    check(lambda a: a.tril(), x)
    check(lambda a: a.triu(1), x)
    check(lambda a: F.pad(a, (1, 2, 0, 1)), x)
    check(lambda a: a.repeat(2, 1), x)
    check(lambda a: a.t().contiguous(), x)
    check(lambda a: a.clone(), x)
    check(lambda a: a.to(torch.float32), x)
    check(lambda a: a.to(torch.int64), x)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_indexing(dtype):
    # Accumulating scatters sum in another order than the CPU loop.
    acc_tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float16 else {}
    x = make((5, 6), dtype)
    idx = torch.tensor([4, 0, 2, 2])
    check(lambda a, i: a.index_select(0, i), x, idx)
    check(lambda a, i: a.index_select(1, i), x, idx)
    check(lambda a, i: a[i], x, idx)
    check(lambda a, i: a[:, i], x, idx)
    check(lambda a, i: a[i, i], x, idx)
    check(lambda a, i: a[i, 1:3], x, idx)
    check(lambda a, i: a[-1, i], x, idx)
    g = torch.tensor([[0, 1, 5], [2, 2, 0], [1, 0, 3], [5, 4, 3], [0, 0, 0]])
    check(lambda a, i: a.gather(1, i), x, g)
    src = make((5, 3), dtype, seed=2)
    check(lambda a, i, s: a.scatter(1, i[:, :1], s[:, :1]), x, g, src)
    check(lambda a, i, s: a.scatter_add(1, i, s), x, g, src, **acc_tol)
    # One index per line (a select, not a scatter): along either dim, with a
    # value, accumulating, and with an index shorter than self (a scatter).
    check(lambda a, i, s: a.scatter(1, i[:, 1:2], 2), x, g, src)
    check(lambda a, i, s: a.scatter_add(1, i[:, 2:3], s[:, 2:3]), x, g, src)
    check(lambda a, i, s: a.t().scatter(0, i[:, :1].t(), s[:, :1].t()), x, g, src)
    check(lambda a, i, s: a.scatter(1, i[:3, :1], s[:3, :1]), x, g, src)
    if dtype.is_floating_point:
        check(lambda a, i, s: a.scatter_reduce(1, i, s, "amax"), x, g, src)
        check(lambda a, i, s: a.scatter_reduce(1, i, s, "mean", include_self=False), x, g, src)
    check(lambda a, i, s: a.index_add(0, i[:3], s[:3].repeat(1, 2)), x, idx, src, **acc_tol)

    def put(a, i, v):
        a = a.clone()
        a[i] = v
        return a

    check(put, x, torch.tensor([1, 3]), make((2, 6), dtype, seed=4))

    def put_acc(a, i, v):
        return a.index_put((i,), v, accumulate=True)

    check(put_acc, x, idx, make((4, 6), dtype, seed=4), **acc_tol)
    check(lambda a: a.masked_fill(a > 0, 7), x)
    check(lambda a, i: F.embedding(i, a), x, torch.tensor([[0, 4], [3, 3]]))


def test_negative_indices_wrap():
    x = make((5, 6), torch.float32)
    check(lambda a, i: a[i], x, torch.tensor([-1, -5, 0]))
    check(lambda a, i: a[:, i], x, torch.tensor([-1, 2]))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_sort_topk(dtype):
    x = make((4, 9), dtype, -100, 100)
    check(lambda a: a.sort(dim=1, stable=True), x)
    check(lambda a: a.sort(dim=0, descending=True, stable=True), x)
    check(lambda a: a.argsort(dim=1, stable=True), x)
    # Ties may pick other (equal) elements than the CPU: compare values, and
    # check that the indices point at them.
    ref = x.topk(3, 1)
    out = x.to("tpu").topk(3, 1)
    torch.testing.assert_close(out.values.cpu(), ref.values)
    torch.testing.assert_close(x.gather(1, out.indices.cpu()), ref.values)


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.uint8], ids=str)
def test_topk_selection_and_sort_paths(dtype):
    # k <= 16 (largest) selects k times; larger k and largest=False sort. Both
    # must give the CPU's values in order, with NaN first, ties, infinities,
    # and distinct indices that point at those values.
    g = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        x = torch.randn(6, 40, generator=g).to(dtype)
        x[:, ::5] = x[:, 1:2]  # ties
        x[0, 3] = x[1, 7] = x[1, 9] = float("nan")
        x[2, 4], x[3, 5] = float("inf"), float("-inf")
        x[4] = float("-inf")  # a row of equal worst values
        x[4, 6] = 1.0
    else:
        x = torch.randint(0, 6, (6, 40), generator=g).to(dtype)
    dev = x.to("tpu")
    for k, dim, largest in [(1, 1, True), (2, 1, True), (5, 1, True), (16, 1, True), (17, 1, True),
                            (3, 0, True), (6, 0, True), (4, 1, False), (40, 1, True)]:
        ref = x.topk(k, dim, largest=largest)
        out = dev.topk(k, dim, largest=largest)
        assert out.values.device.type == "tpu"
        v, i = out.values.cpu(), out.indices.cpu()
        torch.testing.assert_close(v, ref.values, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(x.gather(dim, i), ref.values, equal_nan=True, rtol=0, atol=0)
        assert bool((i.sort(dim).values.diff(dim=dim) > 0).all()), (k, dim, largest)


def test_factories():
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        assert torch.zeros(3, 4, device="tpu", dtype=dtype).cpu().equal(torch.zeros(3, 4, dtype=dtype))
        assert torch.ones(2, device="tpu", dtype=dtype).cpu().equal(torch.ones(2, dtype=dtype))
        assert torch.full((2, 2), 3, device="tpu", dtype=dtype).cpu().equal(torch.full((2, 2), 3, dtype=dtype))
    assert torch.arange(10, device="tpu").cpu().equal(torch.arange(10))
    assert torch.arange(1.5, 7, 0.5, device="tpu").cpu().equal(torch.arange(1.5, 7, 0.5))
    torch.testing.assert_close(torch.linspace(-2, 3, 11, device="tpu").cpu(), torch.linspace(-2, 3, 11))
    assert torch.eye(3, 5, device="tpu").cpu().equal(torch.eye(3, 5))
    assert torch.empty(2, 3, device="tpu").shape == (2, 3)
    x = torch.randn(3, 4)
    assert torch.zeros_like(x.to("tpu")).cpu().equal(torch.zeros_like(x))
    assert torch.ones_like(x.to("tpu")).cpu().equal(torch.ones_like(x))


def test_nn_ops():
    x = make((2, 3, 8, 8), torch.float32)
    w = make((4, 3, 3, 3), torch.float32, seed=1)
    check(lambda a, k: F.conv2d(a, k, padding=1), x, w, rtol=1e-4, atol=1e-4)
    check(lambda a, k: F.conv2d(a, k, stride=2, dilation=2), x, w, rtol=1e-4, atol=1e-4)
    check(lambda a, k: F.conv2d(a, k[:, :1].repeat(1, 1, 1, 1)[:3], groups=3), x, w, rtol=1e-4, atol=1e-4)
    check(lambda a: F.max_pool2d(a, 2), x)
    check(lambda a: F.max_pool2d(a, 3, 2, 1, ceil_mode=True, return_indices=True), x)
    check(lambda a: F.avg_pool2d(a, 3, 2, 1), x)
    check(lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=False, ceil_mode=True), x)
    check(lambda a: F.adaptive_avg_pool2d(a, (3, 5)), x)
    check(lambda a: F.layer_norm(a, (8,)), x, rtol=1e-4, atol=1e-5)
    check(lambda a: F.batch_norm(a, torch.zeros(3, device=a.device), torch.ones(3, device=a.device)), x)
    check(lambda a: F.batch_norm(a, None, None, training=True), x, rtol=1e-4, atol=1e-5)
    logits, target = make((6, 5), torch.float32), torch.tensor([0, 4, 1, 2, 2, 3])
    check(F.cross_entropy, logits, target)
    check(lambda a, t: F.cross_entropy(a, t, reduction="none", ignore_index=2), logits, target)
    check(lambda a, t: F.nll_loss(F.log_softmax(a, 1), t, reduction="sum"), logits, target)
    check(F.mse_loss, logits, make((6, 5), torch.float32, seed=9))
    q = make((2, 2, 5, 4), torch.float32)
    check(lambda a: F.scaled_dot_product_attention(a, a * 0.5, a, is_causal=True), q, rtol=1e-4, atol=1e-5)


def test_rng_reproducible_under_manual_seed():
    torch.manual_seed(123)
    a = torch.randn(100, device="tpu").cpu()
    b = torch.rand(10, device="tpu").cpu()
    torch.manual_seed(123)
    a2 = torch.randn(100, device="tpu").cpu()
    b2 = torch.rand(10, device="tpu").cpu()
    assert a.equal(a2) and b.equal(b2)
    assert not a.equal(torch.randn(100, device="tpu").cpu())
    big = torch.randn(200000, device="tpu").cpu()
    assert abs(big.mean().item()) < 0.02 and abs(big.std().item() - 1) < 0.02
    u = torch.rand(200000, device="tpu").cpu()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    r = torch.randint(3, 9, (10000,), device="tpu").cpu()
    assert r.min() == 3 and r.max() == 8
    bern = torch.bernoulli(torch.full((10000,), 0.3, device="tpu")).cpu()
    assert abs(bern.mean().item() - 0.3) < 0.03
    d = F.dropout(torch.ones(10000, device="tpu"), 0.25).cpu()
    assert abs((d == 0).float().mean().item() - 0.25) < 0.03
    assert torch.allclose(d[d != 0], torch.tensor(1 / 0.75))


def test_foreach_ops_match_per_tensor():
    xs = [make((3, 4), torch.float32, seed=i) for i in range(3)]
    ys = [make((3, 4), torch.float32, seed=10 + i) for i in range(3)]
    check(lambda *t: torch._foreach_add(list(t[:3]), list(t[3:]), alpha=0.5), *xs, *ys)
    check(lambda *t: torch._foreach_mul(list(t), 3.0), *xs)
    check(lambda *t: torch._foreach_addcdiv(list(t[:3]), list(t[3:]), [v.abs() + 1 for v in t[3:]], 0.1), *xs, *ys)
    check(lambda *t: torch._foreach_norm(list(t)), *xs)
    check(lambda *t: torch._foreach_sqrt([v.abs() for v in t]), *xs)

    def inplace(*t):
        a = [v.clone() for v in t[:3]]
        torch._foreach_lerp_(a, list(t[3:]), 0.3)
        torch._foreach_mul_(a, [0.5, 2.0, 3.0])
        return a

    check(inplace, *xs, *ys)


@pytest.mark.parametrize("dim", [-1, 0], ids=["last_dim_kernel", "other_dim"])
@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax], ids=["softmax", "log_softmax"])
def test_softmax_rows_with_inf_and_nan_match_pytorch(fn, dim):
    # A row (column for dim 0) with +inf, one all -inf, one with a NaN: NaN
    # throughout, as on the CPU; the others finite. 16 wide: the row kernel's path.
    x = make((16, 16), torch.float32) * 10
    x[1, 3] = float("inf")
    x[2] = -float("inf")
    x[3, 5] = float("nan")
    x[4, :8] = -float("inf")
    if dim == 0:
        x = x.t().contiguous()
    ref, out = run_both(lambda a: fn(a, dim), x)
    torch.testing.assert_close(out.cpu(), ref, equal_nan=True)
