"""Every collective on tpu tensors through tpu_dist, against gloo on CPU tensors of the
same values, in the same process group. Run by test_distributed.py under torchrun."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import torch_tpu

torch_tpu.set_fallback("error")
# CPU tensors (the reference) go to gloo, tpu tensors to tpu_dist, as "cpu:gloo,cuda:nccl" on GPUs.
dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
assert "tpu:tpu_dist" in dist.get_backend_config(), dist.get_backend_config()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check_collectives  # noqa: E402

checked = check_collectives(rank, size)


def values(dtype, shape=(4, 3), seed=0):
    g = torch.Generator().manual_seed(seed + 17 * rank)
    x = torch.randn(shape, generator=g) * 4
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


def same(name, got, want):
    assert got.device.type == "tpu", (name, got.device)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# A sub-group (each rank alone) and a DeviceMesh dimension.
groups = [dist.new_group([r]) for r in range(size)]
t = values(torch.float32).to("tpu")
before = t.cpu()
dist.all_reduce(t, group=groups[rank])
same("all_reduce in a 1-rank group", t, before)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

mesh = init_device_mesh("tpu", (size,))
t = values(torch.float32).to("tpu")
ref = t.cpu()
dist.all_reduce(ref)
dist.all_reduce(t, group=mesh.get_group(0))
same("all_reduce on a DeviceMesh group", t, ref)

m = torch_tpu.metrics()
assert m["dist_collectives"] > 0 and m["dist_staged_bytes"] > 0, m
print(f"rank {rank}: ok {len(checked)} checks, {m['dist_staged_bytes']} bytes staged", flush=True)
dist.destroy_process_group()
