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
