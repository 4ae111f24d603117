"""NaN and infinities through clamps, min/max, compares and selects (issue 2/6, class 3): every
lowering built from them treats NaN and +-inf as the CPU does. The sweep over all of PyTorch's
OpInfos is `tools/opinfo_sweep.py --special` (docs/nan_walk.md); these are the ops it found and
their neighbours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

pytestmark = pytest.mark.mode_dependent

SPECIAL = torch.tensor([float("nan"), float("inf"), float("-inf"), -7.0, -1.0, -0.25, 0.0, 0.3, 1.0, 6.5, 9.0])

UNARY = {
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "hardtanh(-2, 3)": lambda x: F.hardtanh(x, -2.0, 3.0),
    "hardshrink": F.hardshrink,
    "softshrink": F.softshrink,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "relu": F.relu,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "selu": F.selu,
    "celu": F.celu,
    "gelu": F.gelu,
    "silu": F.silu,
    "mish": F.mish,
    "softplus": F.softplus,
    "threshold": lambda x: F.threshold(x, 0.1, 20.0),
    "clamp": lambda x: x.clamp(-0.5, 0.5),
    "clamp_min": lambda x: x.clamp(min=0.5),
    "clamp_max": lambda x: x.clamp(max=0.5),
    "nan_to_num": torch.nan_to_num,
    "sign": torch.sign,
    "sgn": torch.sgn,
    "abs": torch.abs,
    "round": torch.round,
    "floor": torch.floor,
    "trunc": torch.trunc,
    "frac": torch.frac,
    "logit(eps)": lambda x: torch.logit(x, eps=1e-3),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "erf": torch.erf,
}


# PyTorch's CPU kernel gives NaN for gelu(+inf), CUDA's and tpu's inf: +inf is left out there.
NOT_PLUS_INF = {"gelu"}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unary(name, dtype):
    x = SPECIAL[SPECIAL != float("inf")] if name in NOT_PLUS_INF else SPECIAL
    check_against_cpu(UNARY[name], x.to(dtype), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool])
def test_sign_of_integers(dtype):
    x = torch.tensor([0, 1, 5, 127] + ([] if dtype in (torch.uint8, torch.bool) else [-3, -128]), dtype=torch.int64)
    x = x.to(dtype)
    for fn in (torch.sign, torch.sgn) + (() if dtype == torch.bool else (torch.abs,)):
        check_against_cpu(fn, x)


BINARY = {
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "clamp(t, lo, hi)": lambda x, y: torch.clamp(x, y - 1, y + 1),
    "where(x > y)": lambda x, y: torch.where(x > y, x, y),
    "remainder": torch.remainder,
    "fmod": torch.fmod,
    "atan2": torch.atan2,
    "copysign": torch.copysign,
    "hypot": torch.hypot,
    "xlogy": torch.xlogy,
    "lerp": lambda x, y: torch.lerp(x, y, 0.3),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name):
    y = SPECIAL.flip(0)
    check_against_cpu(BINARY[name], SPECIAL, y, equal_nan=True)


# Reductions along dim 1 (torch.NAME(x, dim=1)), and the whole-tensor ones.
REDUCTIONS = {f"{name}(dim)": (lambda x, name=name: getattr(torch, name)(x, dim=1)) for name in (
    "amax", "amin", "max", "min", "argmax", "argmin", "aminmax", "sum", "prod", "logsumexp", "softmax", "log_softmax",
    "cummax", "cummin", "cumsum", "cumprod", "logcumsumexp", "nansum", "nanmean", "sort", "norm")}
REDUCTIONS.update({"max": torch.max, "min": torch.min, "topk": lambda x: torch.topk(x, 2, dim=1)})


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name):
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("-inf"), 2.0, float("inf")], [0.5, -1.0, 4.0],
                      [float("nan"), float("inf"), -2.0]])
    check_against_cpu(REDUCTIONS[name], x, equal_nan=True)


LOSSES = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "smooth_l1": F.smooth_l1_loss,
    "huber": F.huber_loss,
    "soft_margin": F.soft_margin_loss,
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses(name):
    check_against_cpu(lambda x, y: LOSSES[name](x, y, reduction="none"), SPECIAL, SPECIAL.flip(0) / 2,
                      equal_nan=True)


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", [torch.int8, torch.int16, torch.uint8, torch.int32, torch.int64])
def test_float_to_integer_casts_as_the_cpu_does(src, dst):
    # The CPU's C++ casts: to 8- and 16-bit integers through int32, wrapping; NaN, infinities and
    # values out of int32/int64 range give the minimum. XLA's convert saturated instead.
    x = torch.tensor([40000.5, -40000.5, 300.0, -1.0, -129.7, 255.9, 1e10, -1e10, 3e9, -3e9, 65535.0, 70000.0,
                      float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 2.5])
    check_against_cpu(lambda t: t.to(dst), x.to(src))


# Found by the NaN/inf walk at 5b1d450 (docs/pytorch_rules.md, class 3): each runs natively.
WALK = {
    "softmax of a scalar": lambda x: torch.softmax(x[0], 0),
    "log_softmax of a scalar": lambda x: torch.log_softmax(x[0], 0),
    "floor_divide": lambda x: torch.floor_divide(x, x.flip(0)),
    "div(rounding_mode=floor)": lambda x: torch.div(x, x.flip(0), rounding_mode="floor"),
    "heaviside": lambda x: torch.heaviside(x, torch.tensor(0.5, device=x.device)),
    "native_dropout_backward": lambda x: torch.ops.aten.native_dropout_backward(
        x, torch.arange(x.numel(), device=x.device) % 2 == 0, 2.0),
    "max_pool1d indices": lambda x: F.max_pool1d(x[None, None], 4, return_indices=True),
    "max_pool3d indices": lambda x: F.max_pool3d(x[None, None, None, None], (1, 1, 4), return_indices=True),
    "adaptive_max_pool2d indices": lambda x: F.adaptive_max_pool2d(x[None, None, None], (1, 2), return_indices=True),
    "adaptive_avg_pool1d": lambda x: F.adaptive_avg_pool1d(x[None, None], 3),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x.reshape(1, 2, 6), (1, 4)),
    "interpolate(area)": lambda x: F.interpolate(x[None, None], size=5, mode="area"),
    "scatter_reduce(amax)": lambda x: torch.zeros(3, device=x.device).scatter_reduce(
        0, torch.arange(x.numel(), device=x.device) % 3, x, "amax"),
    "scatter_reduce(amin, include_self=False)": lambda x: torch.zeros(3, device=x.device).scatter_reduce(
        0, torch.arange(x.numel(), device=x.device) % 3, x, "amin", include_self=False),
    "index_reduce(amax)": lambda x: torch.zeros(3, device=x.device).index_reduce(
        0, torch.arange(x.numel(), device=x.device) % 3, x, "amax"),
    "bucketize": lambda x: torch.bucketize(x, torch.tensor([-1.0, 0.0, 1.0, float("inf")], device=x.device)),
    "bucketize(NaN boundary, right)": lambda x: torch.bucketize(
        x, torch.tensor([-1.0, 0.0, 1.0, float("nan")], device=x.device), right=True),
    "searchsorted(sorter)": lambda x: torch.searchsorted(
        torch.tensor([5.0, float("nan"), -1.0, 2.0], device=x.device), x,
        sorter=torch.tensor([2, 3, 0, 1], device=x.device)),
}


@pytest.mark.parametrize("name", sorted(WALK))
def test_walk_findings(name, fallback_error):
    # Two NaNs in the first pooling window: PyTorch's pooling kernels index the last.
    x = torch.tensor([float("nan"), float("inf"), float("nan"), -7.0, -1.0, -0.0, float("-inf"), 1.0, 6.5, 0.0,
                      2.0, 0.3])
    check_against_cpu(WALK[name], x, equal_nan=True)
