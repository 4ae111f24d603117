"""Every collective on tpu tensors against gloo on CPU tensors of the same values, in one
process group whose CPU tensors go to gloo ("cpu:gloo,tpu:tpu_dist"). Shared by the
staged transport's run (collectives.py, one process per rank under torchrun) and the XLA
transport's (test_distributed_xla.py, one thread per rank and device)."""

import torch
import torch.distributed as dist


def check_collectives(rank, size, group=None, device="tpu"):
    """Runs every collective in `group` (None: the default group) and returns the names of
    the checks; raises on the first difference."""
    checked = []
    g = dict(group=group)

    def values(dtype, shape=(4, 3), seed=0):
        gen = torch.Generator().manual_seed(seed + 17 * rank)
        x = torch.randn(shape, generator=gen) * 4
        return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)

    def same(name, got, want):
        if isinstance(got, (list, tuple)):
            for a, b in zip(got, want):
                same(name, a, b)
            return
        want_dev = torch.device(device)
        assert got.device.type == want_dev.type and want_dev.index in (None, got.device.index), (name, got.device)
        # Exact, but for floats beyond 2 ranks: the order of a reduction's additions is the
        # transport's own there, so each partial sum may round differently (inputs are at most
        # about 16 in size: a few units in the last place of that).
        exact = size <= 2 or not want.dtype.is_floating_point
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1.6e-2, atol=size * 16 * torch.finfo(want.dtype).eps)
        torch.testing.assert_close(got.cpu(), want, **tol, msg=lambda m: f"{name}: {m}")

    def both(name, dtype, fn, inputs, check=lambda r: True):
        """fn(tensors...) runs a collective in place; compares tpu against CPU (gloo) on the
        ranks `check` accepts (a reduce defines only the destination's result)."""
        cpu = [t.clone() for t in inputs]
        tpu = [t.clone().to(device) for t in inputs]
        fn(*cpu)
        fn(*tpu)
        if check(rank):
            same(f"{name}[{dtype}]", tpu, cpu)
        checked.append(f"{name}[{dtype}]")

    def averaged(ref, dtype):
        return ref.div(size, rounding_mode="trunc") if not dtype.is_floating_point else ref / size

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = values(dtype)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
        if not dtype.is_floating_point:
            ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
        for op in ops:
            both(f"all_reduce {op}", dtype, lambda t, op=op: dist.all_reduce(t, op, **g), [x])
        # AVG: gloo has none, so the reference is SUM / size.
        t = x.clone().to(device)
        dist.all_reduce(t, dist.ReduceOp.AVG, **g)
        ref = x.clone()
        dist.all_reduce(ref, **g)
        same(f"all_reduce AVG[{dtype}]", t, averaged(ref, dtype))
        if dtype.is_floating_point:
            # PREMUL_SUM (FSDP2's gradient reduction): gloo has none; the reference scales first.
            t = x.clone().to(device)
            dist.all_reduce(t, dist._make_nccl_premul_sum(0.5), **g)
            ref = x.clone() * 0.5
            dist.all_reduce(ref, **g)
            same(f"all_reduce PREMUL_SUM[{dtype}]", t, ref)
            checked.append(f"all_reduce PREMUL_SUM[{dtype}]")
        both("broadcast", dtype, lambda t: dist.broadcast(t, group_src=1, **g), [x])
        both("reduce", dtype, lambda t: dist.reduce(t, group_dst=0, **g), [x], check=lambda r: r == 0)
        zeros = [torch.zeros_like(x) for _ in range(size)]
        both("all_gather", dtype, lambda inp, *outs: dist.all_gather(list(outs), inp, **g), [x, *zeros])
        both("all_gather_into_tensor", dtype, lambda o, i: dist.all_gather_into_tensor(o, i, **g),
             [torch.zeros(size * 4, 3, dtype=dtype), x])
        big = values(dtype, (size * 4, 3), seed=1)
        both("reduce_scatter_tensor", dtype, lambda o, i: dist.reduce_scatter_tensor(o, i, **g),
             [torch.zeros_like(x), big])
        t = torch.zeros_like(x).to(device)
        dist.reduce_scatter_tensor(t, big.to(device), op=dist.ReduceOp.AVG, **g)
        ref = torch.zeros_like(x)
        dist.reduce_scatter_tensor(ref, big.clone(), **g)
        same(f"reduce_scatter_tensor AVG[{dtype}]", t, averaged(ref, dtype))
        if dtype.is_floating_point:
            t = torch.zeros_like(x).to(device)
            factor = torch.tensor(0.25, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(t, big.to(device), op=dist._make_nccl_premul_sum(factor), **g)
            ref = torch.zeros_like(x)
            dist.reduce_scatter_tensor(ref, big.clone() * 0.25, **g)
            same(f"reduce_scatter_tensor PREMUL_SUM[{dtype}]", t, ref)
            checked.append(f"reduce_scatter_tensor PREMUL_SUM[{dtype}]")
        parts = [values(dtype, seed=3 + i) for i in range(size)]
        both("reduce_scatter", dtype, lambda o, *ps: dist.reduce_scatter(o, list(ps), **g), [torch.zeros_like(x), *parts])
        # all_to_all_single with uneven splits: rank r sends r + 1 + j rows to rank j.
        send_splits = [rank + 1 + j for j in range(size)]
        recv_splits = [j + 1 + rank for j in range(size)]
        src = values(dtype, (sum(send_splits), 3), seed=5)
        both("all_to_all_single uneven", dtype,
             lambda o, i: dist.all_to_all_single(o, i, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                                 **g),
             [torch.zeros(sum(recv_splits), 3, dtype=dtype), src])
        both("all_to_all_single", dtype, lambda o, i: dist.all_to_all_single(o, i, **g),
             [torch.zeros(size * 2, 3, dtype=dtype), values(dtype, (size * 2, 3), seed=6)])
        both("all_to_all", dtype, lambda *ts: dist.all_to_all(list(ts[:size]), list(ts[size:]), **g),
             [*zeros, *parts])
        both("gather", dtype, lambda i, *outs: dist.gather(i, list(outs) if rank == 0 else None, group_dst=0, **g),
             [x, *zeros], check=lambda r: r == 0)
        both("scatter", dtype, lambda o, *ins: dist.scatter(o, list(ins) if rank == 0 else None, group_src=0, **g),
             [torch.zeros_like(x), *parts])

        def send_recv(t):
            if rank == 0:
                dist.send(t, group_dst=1, **g)
            elif rank == 1:
                dist.recv(t, group_src=0, **g)

        both("send/recv", dtype, send_recv, [x])

        def ring(s, r):
            # Each rank sends to the next and receives from the one before: both posted first.
            ops = [dist.P2POp(dist.isend, s, group_peer=(rank + 1) % size, **g),
                   dist.P2POp(dist.irecv, r, group_peer=(rank - 1) % size, **g)]
            for q in dist.batch_isend_irecv(ops):
                q.wait()

        both("batch_isend_irecv", dtype, ring, [x, torch.zeros_like(x)])

    # async_op: the work is complete when wait() returns and the future carries the result.
    t = values(torch.float32).to(device)
    work = dist.all_reduce(t, async_op=True, **g)
    work.wait()
    fut = dist.all_reduce(t.clone(), async_op=True, **g).get_future()
    assert fut.wait()[0].device.type == "tpu"
    dist.barrier(**g)
    return checked
