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
checked = []


def values(dtype, shape=(4, 3), seed=0):
    g = torch.Generator().manual_seed(seed + 17 * rank)
    x = torch.randn(shape, generator=g) * 4
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


def same(name, got, want):
    if isinstance(got, (list, tuple)):
        for g, w in zip(got, want):
            same(name, g, w)
        return
    assert got.device.type == "tpu", (name, got.device)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def both(name, dtype, fn, inputs, check=lambda r: True):
    """fn(tensors...) runs a collective in place; compares tpu against CPU (gloo) on the
    ranks `check` accepts (a reduce defines only the destination's result)."""
    cpu = [t.clone() for t in inputs]
    tpu = [t.clone().to("tpu") for t in inputs]
    fn(*cpu)
    fn(*tpu)
    if check(rank):
        same(f"{name}[{dtype}]", tpu, cpu)
    checked.append(f"{name}[{dtype}]")


for dtype in (torch.float32, torch.bfloat16, torch.int64):
    x = values(dtype)
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    for op in ops:
        both(f"all_reduce {op}", dtype, lambda t, op=op: dist.all_reduce(t, op), [x])
    # AVG: gloo has none, so the reference is SUM / size.
    t = x.clone().to("tpu")
    dist.all_reduce(t, dist.ReduceOp.AVG)
    ref = x.clone()
    dist.all_reduce(ref)
    ref = ref.div(size, rounding_mode="trunc") if not dtype.is_floating_point else ref / size
    same(f"all_reduce AVG[{dtype}]", t, ref)
    both("broadcast", dtype, lambda t: dist.broadcast(t, src=1), [x])
    both("reduce", dtype, lambda t: dist.reduce(t, dst=0), [x], check=lambda r: r == 0)

    def all_gather(out0, out1, inp):
        dist.all_gather([out0, out1], inp)

    both("all_gather", dtype, all_gather, [torch.zeros_like(x), torch.zeros_like(x), x])
    both("all_gather_into_tensor", dtype, lambda o, i: dist.all_gather_into_tensor(o, i),
         [torch.zeros(size * 4, 3, dtype=dtype), x])
    big = values(dtype, (size * 4, 3), seed=1)
    both("reduce_scatter_tensor", dtype, lambda o, i: dist.reduce_scatter_tensor(o, i), [torch.zeros_like(x), big])
    t = torch.zeros_like(x).to("tpu")
    dist.reduce_scatter_tensor(t, big.to("tpu"), op=dist.ReduceOp.AVG)
    ref = torch.zeros_like(x)
    dist.reduce_scatter_tensor(ref, big.clone())
    ref = ref.div(size, rounding_mode="trunc") if not dtype.is_floating_point else ref / size
    same(f"reduce_scatter_tensor AVG[{dtype}]", t, ref)
    parts = [values(dtype, seed=3 + i) for i in range(size)]
    both("reduce_scatter", dtype, lambda o, a, b: dist.reduce_scatter(o, [a, b]), [torch.zeros_like(x), *parts])
    # all_to_all_single with uneven splits: rank r sends r + 1 + j rows to rank j.
    send_splits = [rank + 1 + j for j in range(size)]
    recv_splits = [j + 1 + rank for j in range(size)]
    src = values(dtype, (sum(send_splits), 3), seed=5)
    both("all_to_all_single uneven", dtype,
         lambda o, i: dist.all_to_all_single(o, i, output_split_sizes=recv_splits, input_split_sizes=send_splits),
         [torch.zeros(sum(recv_splits), 3, dtype=dtype), src])
    both("all_to_all_single", dtype, lambda o, i: dist.all_to_all_single(o, i),
         [torch.zeros(size * 2, 3, dtype=dtype), values(dtype, (size * 2, 3), seed=6)])

    def all_to_all(o0, o1, i0, i1):
        dist.all_to_all([o0, o1], [i0, i1])

    both("all_to_all", dtype, all_to_all, [torch.zeros_like(x), torch.zeros_like(x), parts[0], parts[1]])

    def gather(o0, o1, i):
        dist.gather(i, [o0, o1] if rank == 0 else None, dst=0)

    both("gather", dtype, gather, [torch.zeros_like(x), torch.zeros_like(x), x], check=lambda r: r == 0)

    def scatter(o, i0, i1):
        dist.scatter(o, [i0, i1] if rank == 0 else None, src=0)

    both("scatter", dtype, scatter, [torch.zeros_like(x), parts[0], parts[1]])

    def send_recv(t):
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)

    both("send/recv", dtype, send_recv, [x])

    def batch_p2p(s, r):
        peer = 1 - rank
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)])
        for q in reqs:
            q.wait()

    both("batch_isend_irecv", dtype, batch_p2p, [x, torch.zeros_like(x)])

# async_op: the work is complete when wait() returns and the future carries the result.
t = values(torch.float32).to("tpu")
work = dist.all_reduce(t, async_op=True)
work.wait()
fut = dist.all_reduce(t.clone(), async_op=True).get_future()
assert fut.wait()[0].device.type == "tpu"
dist.barrier()

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
