"""Errors PyTorch raises are raised on tpu too (issue 2/6, class 4): the same exception type as
the CPU, for writes through memory an input shares, out= dtypes, in-place ops whose result would
have to grow self, factories with invalid sizes, index shapes that do not broadcast, and
random_'s range checks and warnings. Each case runs on the CPU first: a case the CPU does not
refuse fails here."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401  (registers the device)

pytestmark = pytest.mark.mode_dependent


def raised(fn, device):
    try:
        out = fn(device)
        if isinstance(out, torch.Tensor) and out.device.type == "tpu":
            out.cpu()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, ""


def same_error(fn, match=None):
    cpu_type, cpu_msg = raised(fn, "cpu")
    assert cpu_type is not None, "the CPU raises nothing here: not a case"
    tpu_type, tpu_msg = raised(fn, "tpu")
    assert tpu_type is cpu_type, f"CPU: {cpu_type.__name__}: {cpu_msg[:200]}; tpu: {tpu_type} {tpu_msg[:300]}"
    if match:
        assert match in tpu_msg, tpu_msg


OVERLAP = {
    "cat(out=an input)": lambda d: (lambda a: torch.cat([a, torch.ones(2, device=d)], out=a))(torch.ones(2, device=d)),
    "cat(out=a view of an input)": lambda d: (lambda a: torch.cat([a[:2], a[2:]], out=a[1:]))(torch.ones(5, device=d)),
    "index_copy_ from inside self": lambda d: (lambda x: x.index_copy_(0, torch.tensor([0, 1], device=d), x[1:3]))(
        torch.arange(5.0, device=d)),
    "add_ of a view of self": lambda d: (lambda x: x[1:].add_(x[:-1]))(torch.arange(5.0, device=d)),
    "mul(out=partly an input)": lambda d: (lambda x: torch.mul(x[:-1], 2, out=x[1:]))(torch.arange(5.0, device=d)),
    "expanded in-place write": lambda d: torch.ones(1, 3, device=d).expand(2, 3).add_(1),
    # addr_ decomposed above the device before it had a lowering: no check ran.
    "addr_ of a vector inside self": lambda d: (lambda x: x.addr_(x.view(-1)[:3], torch.ones(3, device=d)))(
        torch.arange(9.0, device=d).reshape(3, 3)),
    # Self as another argument of the in-place op: refused by kernels that call assert_no_overlap
    # on their inputs other than self (the overlap table's "source" rows).
    **{f"{name} with self as its source": (lambda d, name=name: (lambda x: SOURCE_IS_SELF[name](
        x, torch.arange(5, device=d)))(torch.arange(5.0, device=d))) for name in (
        "index_copy_", "index_add_", "index_reduce_", "scatter_", "scatter_add_", "scatter_reduce_", "index_put_",
        "put_")},
}

SOURCE_IS_SELF = {
    "index_copy_": lambda x, i: x.index_copy_(0, i, x),
    "index_add_": lambda x, i: x.index_add_(0, i, x),
    "index_reduce_": lambda x, i: x.index_reduce_(0, i, x, "prod"),
    "scatter_": lambda x, i: x.scatter_(0, i, x),
    "scatter_add_": lambda x, i: x.scatter_add_(0, i, x),
    "scatter_reduce_": lambda x, i: x.scatter_reduce_(0, i, x, "sum"),
    "index_put_": lambda x, i: x.index_put_((i,), x),
    "put_": lambda x, i: x.put_(i, x),
}


@pytest.mark.parametrize("name", ["index_copy", "index_add"])
def test_out_may_be_self_where_the_source_may_not(name):
    def fn(d):
        x = torch.arange(5.0, device=d)
        getattr(torch, name)(x, 0, torch.tensor([4, 0], device=d), torch.ones(2, device=d), out=x)
        return x

    torch.testing.assert_close(fn("tpu").cpu(), fn("cpu"))


@pytest.mark.parametrize("case", sorted(OVERLAP))
def test_overlapping_writes(case):
    same_error(OVERLAP[case], "memory location")


BROADCAST_GROWS_SELF = {
    "atan2_": lambda d: torch.ones(3, device=d).atan2_(torch.ones(2, 3, device=d)),
    "add_": lambda d: torch.ones(3, device=d).add_(torch.ones(2, 3, device=d)),
    "copysign_": lambda d: torch.ones(3, device=d).copysign_(torch.ones(2, 3, device=d)),
    "lerp_": lambda d: torch.ones(3, device=d).lerp_(torch.ones(2, 3, device=d), 0.5),
    "addcmul_": lambda d: torch.ones(3, device=d).addcmul_(torch.ones(2, 3, device=d), torch.ones(3, device=d)),
    "pow_": lambda d: torch.ones(3, device=d).pow_(torch.ones(2, 3, device=d)),
    "where(out=)": lambda d: torch.where(torch.ones(2, 3, dtype=torch.bool, device=d), 1.0, 0.0,
                                          out=torch.ones(3, device=d)),
}


@pytest.mark.parametrize("case", sorted(BROADCAST_GROWS_SELF))
def test_in_place_broadcast_that_would_grow_self(case):
    same_error(BROADCAST_GROWS_SELF[case])


def test_out_dtypes():
    same_error(lambda d: torch.all(torch.ones(3, device=d), dim=0, out=torch.empty((), device=d)))
    same_error(lambda d: torch.any(torch.ones(3, device=d), dim=0, out=torch.empty((), dtype=torch.int32, device=d)))
    same_error(lambda d: torch.add(torch.ones(3, device=d), 1.5, out=torch.empty(3, dtype=torch.int64, device=d)))


def test_elu_in_place_with_a_negative_alpha():
    def fn(d):
        x = torch.randn(4, device=d, requires_grad=True)
        y = F.elu_(x.clone(), alpha=-2.0)
        y.sum().backward()

    same_error(fn, "negative slope")


FACTORIES = {
    "empty(-1)": lambda d: torch.empty(-1, device=d),
    "zeros(2, -3)": lambda d: torch.zeros(2, -3, device=d),
    "full((-1,))": lambda d: torch.full((-1,), 1.0, device=d),
    "ones overflowing": lambda d: torch.ones(2**62, 2**62, device=d),
    "randn(-2)": lambda d: torch.randn(-2, device=d),
    "arange with the wrong step sign": lambda d: torch.arange(0, 5, -1, device=d),
    "arange with a zero step": lambda d: torch.arange(0, 5, 0, device=d),
    "linspace with negative steps": lambda d: torch.linspace(0, 1, -2, device=d),
    "eye(-1)": lambda d: torch.eye(-1, device=d),
    "empty_strided with a negative stride": lambda d: torch.empty_strided((2,), (-1,), device=d),
}


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_factories_with_invalid_sizes(case):
    same_error(FACTORIES[case])


INDEX_SHAPES = {
    "indices that do not broadcast": lambda d: torch.zeros(4, 4, device=d)[torch.tensor([0, 1], device=d),
                                                                          torch.tensor([0, 1, 2], device=d)],
    "mask of another shape": lambda d: torch.zeros(4, device=d)[torch.tensor([True, False, True], device=d)],
    "2-d mask of another shape": lambda d: torch.zeros(3, 4, device=d)[torch.ones(3, 3, dtype=torch.bool, device=d)],
    "index_put values of another shape": lambda d: torch.zeros(4, device=d).index_put_(
        (torch.tensor([0, 1, 2], device=d),), torch.ones(2, device=d)),
    "setitem values of another shape": lambda d: torch.zeros(4, 3, device=d).__setitem__(
        torch.tensor([0, 1], device=d), torch.ones(3, 3, device=d)),
    "index_select of a 2-d index": lambda d: torch.zeros(4, device=d).index_select(0, torch.zeros(2, 2, dtype=torch.long,
                                                                                                   device=d)),
    "gather of another rank": lambda d: torch.zeros(4, 4, device=d).gather(1, torch.zeros(4, dtype=torch.long, device=d)),
}


def test_an_empty_gather_index_of_another_rank_is_allowed_as_on_the_cpu():
    x = torch.arange(5.0)
    idx = torch.zeros(2, 0, dtype=torch.long)
    assert torch.gather(x.to("tpu"), 0, idx.to("tpu")).cpu().shape == torch.gather(x, 0, idx).shape == (2, 0)


@pytest.mark.parametrize("case", sorted(INDEX_SHAPES))
def test_index_shapes(case):
    # PyTorch's own words (the first of them), not an IR message about broadcastTo.
    cpu_msg = raised(INDEX_SHAPES[case], "cpu")[1]
    same_error(INDEX_SHAPES[case], cpu_msg.split(":")[0][:30])


def test_random_range_checks_and_warnings():
    same_error(lambda d: torch.empty(3, dtype=torch.int8, device=d).random_(0, 1000), "out of bounds")
    same_error(lambda d: torch.empty(3, device=d).random_(5, 5), "from")
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        for dev in ("cpu", "tpu"):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.empty(3, dtype=dt, device=dev).random_(0, 2**60)
            said = [str(x.message) for x in w if "out of bounds" in str(x.message)]
            assert said and "precision limitations" in said[0], (dt, dev, [str(x.message) for x in w])


# Found by PyTorch's own type-promotion and shape tests run against tpu.
KERNEL_ONLY_CHECKS = {
    # TensorIterator with all dtypes the same: out= of another dtype raises, it does not cast.
    **{f"{name}(out=float64)": (lambda d, name=name: getattr(torch, name)(
        torch.ones(4, device=d), out=torch.ones(4, dtype=torch.float64, device=d)))
       for name in ("neg", "abs", "ceil", "floor", "frac", "round", "sgn", "sign", "trunc")},
    "bitwise_not(out=int64)": lambda d: torch.bitwise_not(torch.ones(4, dtype=torch.int32, device=d),
                                                          out=torch.ones(4, dtype=torch.int64, device=d)),
    "add(bool, bool, alpha=1.5)": lambda d: torch.add(torch.ones(4, dtype=torch.bool, device=d),
                                                      torch.ones(4, dtype=torch.bool, device=d), alpha=1.5),
    "add_(bool, alpha=1.5)": lambda d: torch.ones(4, dtype=torch.bool, device=d).add_(
        torch.ones(4, dtype=torch.bool, device=d), alpha=1.5),
}


@pytest.mark.parametrize("case", sorted(KERNEL_ONLY_CHECKS))
def test_checks_only_the_kernels_make(case):
    same_error(KERNEL_ONLY_CHECKS[case])


@pytest.mark.parametrize("op", ["nonzero", "sum"])
def test_an_out_tensor_on_the_cpu_is_refused(op):
    # A 0-d CPU tensor joins tpu ops as an input scalar, never as the result (as on CUDA); the
    # CPU accepts it as out= of a CPU op, so the two are not compared here.
    x = torch.ones(4, device="tpu")
    out = torch.empty((), dtype=torch.long if op == "nonzero" else torch.float32)
    with pytest.raises(RuntimeError, match="on the same device"):
        getattr(torch, op)(x, out=out) if op == "nonzero" else torch.sum(x, 0, out=out)
    assert out.shape == ()


def test_complex_abs_writes_its_real_type_and_bool_alpha_true_is_allowed():
    z = torch.tensor([3 + 4j, -1j], device="tpu")
    assert torch.abs(z, out=torch.empty(2, device="tpu")).tolist() == [5.0, 1.0]
    b = torch.tensor([True, False], device="tpu")
    assert torch.add(b, b, alpha=True).tolist() == [True, False]


def test_a_uint8_index_warns_as_on_the_cpu():
    for device in ("cpu", "tpu"):
        v = torch.tensor([True, False, True], device=device)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert v[torch.tensor([1, 0, 0], dtype=torch.uint8, device=device)].cpu().tolist() == [True]
        assert [str(m.message).split(" (Triggered")[0] for m in w] == [
            "indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead."], device


def _pair(d, values=torch.float32, indices=torch.long):
    return torch.empty(0, dtype=values, device=d), torch.empty(0, dtype=indices, device=d)


# Found by PyTorch's own reduction tests run against tpu.
REDUCTION_CHECKS = {
    # The kernels keep the reduced dims in a 64-bit mask.
    **{f"{name} of 65 dims": (lambda d, name=name: getattr(torch, name)(torch.ones([1] * 65, device=d), dim=0))
       for name in ("nansum", "argmax", "argmin", "max", "min")},
    # max/min over a dim of size 0 have no value to give.
    **{f"{name} over an empty dim": (lambda d, name=name: getattr(torch, name)(torch.ones(2, 0, 4, device=d), dim=1))
       for name in ("max", "min")},
    # (values, indices) outputs of another dtype.
    "mode(out=int8 values)": lambda d: torch.mode(torch.ones(10, dtype=torch.uint8, device=d), -1,
                                                  out=_pair(d, torch.int8)),
    "mode(out=int32 indices)": lambda d: torch.mode(torch.ones(10, device=d), -1, out=_pair(d, indices=torch.int32)),
    "sort(out=int32 indices)": lambda d: torch.sort(torch.ones(5, 4, device=d), 1, out=_pair(d, indices=torch.int32)),
    "sort(out=float64 values)": lambda d: torch.sort(torch.ones(5, 4, device=d), 1, out=_pair(d, torch.float64)),
    "kthvalue(out=int32 indices)": lambda d: torch.kthvalue(torch.ones(5, 4, device=d), 2, 1,
                                                            out=_pair(d, indices=torch.int32)),
    "cummax(out=float64 values)": lambda d: torch.cummax(torch.ones(5, 4, device=d), 1, out=_pair(d, torch.float64)),
    "cummin(out=int32 indices)": lambda d: torch.cummin(torch.ones(5, 4, device=d), 1,
                                                        out=_pair(d, indices=torch.int32)),
    "median(out=int32 indices)": lambda d: torch.median(torch.ones(5, 4, device=d), 1,
                                                        out=_pair(d, indices=torch.int32)),
}


@pytest.mark.parametrize("case", sorted(REDUCTION_CHECKS))
def test_reduction_checks_only_the_kernels_make(case):
    same_error(REDUCTION_CHECKS[case], raised(REDUCTION_CHECKS[case], "cpu")[1].split(":")[0][:40])


@pytest.mark.parametrize("name", ["var", "std", "var_mean", "std_mean"])
def test_no_degrees_of_freedom_warns_as_on_the_cpu(name):
    fn = getattr(torch, name)
    for dev in ("cpu", "tpu"):
        x = torch.ones(10, 20, device=dev)
        for kwargs in ({"dim": -1, "correction": 20}, {"dim": 0, "correction": 10}):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                fn(x, **kwargs)
            said = [str(m.message) for m in w if "degrees of freedom" in str(m.message)]
            assert said and said[0].startswith(f"{name}(): degrees of freedom is <= 0"), (dev, kwargs, said)
        with warnings.catch_warnings(record=True) as w:  # one degree of freedom left: no warning
            warnings.simplefilter("always")
            fn(x, dim=-1, correction=19)
        assert not [m for m in w if "degrees of freedom" in str(m.message)], dev


def test_all_and_any_over_an_empty_dim_list_keep_every_element():
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    for fn in (torch.all, torch.any):
        assert torch.equal(fn(x.to("tpu"), dim=[]).cpu(), fn(x, dim=[]))
        assert torch.equal(fn(x.to("tpu"), dim=[], keepdim=True).cpu(), fn(x, dim=[], keepdim=True))


# A scalar argument is an input of the cached program, so the meta kernel that checks it ran only
# when the program was built: after a good call, a bad value went through (PyTorch's
# test_reductions found histc's).
SCALAR_RANGES = {
    "histc(min > max)": (lambda x: torch.histc(x, bins=4, min=0, max=3), lambda x: torch.histc(x, bins=4, min=5, max=1)),
    "histc(max nan)": (lambda x: torch.histc(x, bins=4, min=0, max=3),
                       lambda x: torch.histc(x, bins=4, min=0, max=float("nan"))),
    "uniform_(from > to)": (lambda x: x.clone().uniform_(0, 1), lambda x: x.clone().uniform_(5, 1)),
    "uniform_(to - from too wide)": (lambda x: x.clone().uniform_(0, 1), lambda x: x.clone().uniform_(-3e38, 3e38)),
    "bernoulli_(p=2)": (lambda x: x.clone().bernoulli_(0.5), lambda x: x.clone().bernoulli_(2.0)),
    "bernoulli(p=-0.1)": (lambda x: torch.bernoulli(x, 0.5), lambda x: torch.bernoulli(x, -0.1)),
}


@pytest.mark.parametrize("case", sorted(SCALAR_RANGES))
def test_a_bad_scalar_after_a_good_one_raises_as_on_the_cpu(case):
    good, bad = SCALAR_RANGES[case]
    with pytest.raises(RuntimeError) as cpu:
        bad(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.tensor([1.0, 2.0, 3.0], device="tpu")
    good(x).cpu()  # the program, cached
    with pytest.raises(RuntimeError) as tpu:
        bad(x).cpu()
    assert str(cpu.value).split("(")[0][:40] in str(tpu.value)


# index_add / index_reduce with a source that does not fit self (the zero-size walk found
# index_reduce's: it returned a value; index_add's gave the compiler's error).
INDEX_SOURCE = {
    "index_reduce(source of another shape)": lambda d: torch.zeros(3, 5, device=d).index_reduce(
        1, torch.zeros(10, dtype=torch.long, device=d), torch.ones(4, 10, device=d), "amax"),
    "index_reduce(one index too many)": lambda d: torch.zeros(3, 5, device=d).index_reduce(
        1, torch.zeros(10, dtype=torch.long, device=d), torch.ones(3, 9, device=d), "prod"),
    "index_reduce(empty self, source of another shape)": lambda d: torch.zeros(0, 5, device=d).index_reduce(
        1, torch.zeros(10, dtype=torch.long, device=d), torch.ones(5, 10, device=d), "mean"),
    "index_add(source of another shape)": lambda d: torch.zeros(3, 5, device=d).index_add(
        1, torch.zeros(10, dtype=torch.long, device=d), torch.ones(4, 10, device=d)),
    "index_add(source of another rank)": lambda d: torch.zeros(3, 5, device=d).index_add(
        1, torch.zeros(10, dtype=torch.long, device=d), torch.ones(3, 10, 2, device=d)),
}


@pytest.mark.parametrize("case", sorted(INDEX_SOURCE))
def test_an_index_source_that_does_not_fit_raises_as_on_the_cpu(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # index_reduce is in beta
        same_error(INDEX_SOURCE[case], raised(INDEX_SOURCE[case], "cpu")[1].split(".")[0][:40])


# A convolution weight with fewer channels in dim 0 than groups (the zero-size walk: tpu gave an
# empty result where PyTorch's shape check, on every device, raises).
CONV_WEIGHTS = {
    "conv1d(weight [0, 1, 3])": lambda d: F.conv1d(torch.randn(2, 1, 5, device=d), torch.randn(0, 1, 3, device=d)),
    "conv2d(weight [0, 1, 3, 3])": lambda d: F.conv2d(torch.randn(1, 1, 5, 5, device=d),
                                                     torch.randn(0, 1, 3, 3, device=d)),
    "conv3d(empty batch, weight [0, ...])": lambda d: F.conv3d(torch.randn(0, 1, 5, 5, 5, device=d),
                                                               torch.randn(0, 1, 4, 4, 4, device=d)),
    "conv2d(groups=2, weight [1, ...])": lambda d: F.conv2d(torch.randn(1, 2, 5, 5, device=d),
                                                           torch.randn(1, 1, 3, 3, device=d), groups=2),
    "conv_transpose2d(weight [0, 1, 3, 3])": lambda d: F.conv_transpose2d(torch.randn(0, 0, 5, 5, device=d),
                                                                         torch.randn(0, 1, 3, 3, device=d)),
}


@pytest.mark.parametrize("case", sorted(CONV_WEIGHTS))
def test_a_convolution_weight_with_too_few_channels_raises(case):
    same_error(CONV_WEIGHTS[case], "expected weight to be at least")


@pytest.mark.parametrize("channels", [0, 2])
def test_a_transposed_convolution_input_of_other_channels_raises(channels):
    # 2: the compiler refused the program; 0: an empty result.
    same_error(lambda d: F.conv_transpose2d(torch.randn(1, channels, 4, 4, device=d), torch.randn(3, 3, 3, 3, device=d)),
               "to have 3 channels")
