"""Zero-size inputs (issue 2/6, class 6): what the zero-size walk (`tools/opinfo_sweep.py --empty`)
found. Each op computes natively what the CPU computes, or raises what the CPU raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

pytestmark = pytest.mark.mode_dependent

EMPTY_BATCH = {
    # PyTorch's own meta kernel raises a TypeError for an empty batch; the CPU kernel accepts it.
    "upsample_nearest1d": lambda x: F.interpolate(x, size=3, mode="nearest"),
    "upsample_nearest-exact1d": lambda x: F.interpolate(x, size=3, mode="nearest-exact"),
    "upsample_nearest2d": lambda x: F.interpolate(x[..., None], size=(3, 2), mode="nearest"),
    # torch._refs' vector_norm refuses the inf norm over a non-empty dim of an empty tensor.
    "vector_norm(inf)": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=-1),
    "vector_norm(-inf)": lambda x: torch.linalg.vector_norm(x, float("-inf"), dim=-1),
    "logcumsumexp over the empty dim": lambda x: torch.logcumsumexp(x, 0),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 2),
    "adaptive_avg_pool1d": lambda x: F.adaptive_avg_pool1d(x, 2),
    "interpolate(area)": lambda x: F.interpolate(x, size=2, mode="area"),
}


@pytest.mark.parametrize("name", sorted(EMPTY_BATCH))
def test_empty_batch(name, fallback_error):
    check_against_cpu(EMPTY_BATCH[name], torch.randn(0, 3, 4))


def test_a_refusing_meta_kernel_still_gives_the_cpu_error():
    # The CPU's check on the non-empty case stands: the CPU accepting an empty batch does not
    # turn bad input into a result.
    x = torch.randn(0, 3, 0)
    with pytest.raises(RuntimeError) as cpu:
        F.interpolate(x, size=3, mode="nearest")
    with pytest.raises(RuntimeError) as tpu:
        F.interpolate(x.to("tpu"), size=3, mode="nearest")
    assert str(cpu.value).split("\n")[0] in str(tpu.value)


def test_indexing_a_dim_of_size_zero(fallback_error):
    # PyTorch's index test: an index into a dim of size 0 is out of bounds without reading the
    # data; tpu compiled a gather with a zero-size window and the compiler refused it.
    for device in ("cpu", "tpu"):
        x = torch.empty(10, 0, device=device)
        with pytest.raises(IndexError, match="for dimension with size 0"):
            x[:, [0, 1]]
        assert x[[1, 2]].shape == (2, 0) and x[[], []].shape == (0,)


def _ix(dev):
    return torch.tensor([0], device=dev)


INTO_AN_EMPTY_DIM = {
    # A non-empty index into a dimension of size 0: every value is out of range. tpu computed
    # an empty result (scatter, put, index_put: the all-empty shortcut) or handed the compiler a
    # gather it refused (gather, index_select).
    "scatter": lambda e, d: e.scatter(0, torch.zeros(2, 3, dtype=torch.long, device=d), 1.0),
    "scatter_add": lambda e, d: e.scatter_add(0, torch.zeros(2, 3, dtype=torch.long, device=d), e.new_ones(2, 3)),
    "scatter_reduce": lambda e, d: e.scatter_reduce(
        0, torch.zeros(2, 3, dtype=torch.long, device=d), e.new_ones(2, 3), "amax"
    ),
    "scatter_ dim 1": lambda e, d: e.t().scatter_(1, torch.zeros(3, 1, dtype=torch.long, device=d), 1.0),
    "index_reduce": lambda e, d: e.index_reduce(0, _ix(d), e.new_ones(1, 3), "prod"),
    "index_copy": lambda e, d: e.index_copy(0, _ix(d), e.new_ones(1, 3)),
    "index_fill": lambda e, d: e.index_fill(0, _ix(d), 1.0),
    "index_select": lambda e, d: e.index_select(0, _ix(d)),
    "gather": lambda e, d: e.gather(0, torch.zeros(2, 3, dtype=torch.long, device=d)),
    "put": lambda e, d: e.put(_ix(d), e.new_ones(1)),
    "index_put": lambda e, d: e.index_put((_ix(d),), e.new_ones(3)),
    "setitem after a slice": lambda e, d: e.t().__setitem__((slice(None), _ix(d)), 1.0),
}


@pytest.mark.parametrize("name", sorted(INTO_AN_EMPTY_DIM))
def test_an_index_into_an_empty_dim_raises_as_on_the_cpu(name, fallback_error):
    import warnings

    fn = INTO_AN_EMPTY_DIM[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # index_reduce is in beta
        with pytest.raises((RuntimeError, IndexError)) as cpu:
            fn(torch.zeros(0, 3), "cpu")
        with pytest.raises(cpu.type):
            fn(torch.zeros(0, 3, device="tpu"), "tpu")


def test_an_empty_index_into_an_empty_dim_is_no_error(fallback_error):
    # The same ops with an empty index (and index_add, whose CPU kernel accepts either) give the
    # CPU's empty results.
    none = torch.zeros(0, 3, dtype=torch.long)
    check_against_cpu(lambda e, i: e.scatter(0, i, 1.0), torch.zeros(0, 3), none)
    check_against_cpu(lambda e, i: e.gather(0, i), torch.zeros(0, 3), none)
    check_against_cpu(lambda e, i: e.index_select(0, i), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    check_against_cpu(lambda e, i: e.index_add(0, i, e.new_ones(1, 3)), torch.zeros(0, 3), torch.tensor([0]))
