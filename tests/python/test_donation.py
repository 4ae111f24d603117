"""Strict eager writes an in-place op's big argument in place: the argument's
buffer goes to the program (donated) instead of being copied whole, unless
something else still holds that buffer."""
import pytest
import torch

import torch_tpu

# Strict eager's rule (fused eager donates per graph, tested in test_fused.py).
pytestmark = pytest.mark.skipif(torch_tpu.get_mode() != "strict", reason="strict eager's donation")

N = 1 << 18  # rows of 4 floats: 4 MiB, above the 1 MiB donation threshold


def donated():
    return torch_tpu.metrics()["donated_buffers"]


def test_index_put_into_a_big_tensor_donates_its_buffer():
    x = torch.randn(N, 4, device="tpu")
    ref = x.cpu()
    rows = torch.tensor([3, 70000, N - 1], device="tpu")
    val = torch.randn(3, 4, device="tpu")
    view = x[1:]  # a view shares the storage: it sees the new buffer
    before = donated()
    for _ in range(3):
        x.index_put_((rows,), val)
    assert donated() - before == 3
    ref[rows.cpu()] = val.cpu()
    assert torch.equal(x.cpu(), ref)
    assert torch.equal(view.cpu(), ref[1:])


def test_a_buffer_held_elsewhere_is_not_donated():
    # torch.zeros of up to 4 MiB hands out a kept buffer of the device's fill
    # cache: writing into it in place would change every later torch.zeros.
    x = torch.zeros(N, 4, device="tpu")
    x.index_put_((torch.tensor([5], device="tpu"),), torch.ones(1, 4, device="tpu"))
    assert x[5].sum().item() == 4
    assert torch.zeros(N, 4, device="tpu").abs().sum().item() == 0


def test_small_tensors_and_views_keep_their_path():
    x = torch.arange(12.0, device="tpu")
    before = donated()
    x.add_(1)
    x.view(3, 4)[1].mul_(2)
    assert donated() == before
    assert x.cpu().tolist() == [1, 2, 3, 4, 10, 12, 14, 16, 9, 10, 11, 12]
