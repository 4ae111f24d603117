"""First calls that spent their time compiling (issue 2/6, class 9): ops PyTorch decomposes into
many small ops, each a program compiled per shape, lowered as one program. cdist's matrix-product
form (_euclidean_dist) was ten programs; _masked_softmax ran on the CPU."""

from __future__ import annotations

import pytest
import torch

import torch_tpu
from conftest import assert_tpu_close

pytestmark = pytest.mark.mode_dependent


def compiles():
    return torch_tpu.metrics()["compiles"]


@pytest.mark.parametrize("shapes", [((4, 20, 5), (4, 30, 5)), ((30, 3), (40, 3)), ((2, 3, 26, 4), (2, 3, 27, 4))])
def test_cdist_by_matrix_products_is_one_program(shapes, fallback_error):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(*shapes[0], generator=g), torch.randn(*shapes[1], generator=g)
    ta, tb = a.to("tpu"), b.to("tpu")
    torch.tpu.synchronize()
    before = compiles()
    assert_tpu_close(torch.cdist(ta, tb), torch.cdist(a, b))
    if torch_tpu.get_mode() == "strict":
        assert compiles() - before <= 1


@pytest.mark.parametrize("mask_type", [None, 0, 1, 2])
def test_masked_softmax_natively(mask_type, fallback_error):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 8, generator=g)
    shape = {None: (2, 3, 8, 8), 0: (8, 8), 1: (2, 8), 2: (2, 3, 8, 8)}[mask_type]
    mask = torch.rand(*shape, generator=g) > 0.5
    mask[..., 0] = True
    if mask_type != 1:
        mask[..., 0, :] = True  # a row with every position masked: NaN, as on the CPU
    args = (3,) if mask_type is None else (3, mask_type)
    want = torch.ops.aten._masked_softmax(x, mask, *args)
    got = torch.ops.aten._masked_softmax(x.to("tpu"), mask.to("tpu"), *args)
    assert_tpu_close(got, want, equal_nan=True)
