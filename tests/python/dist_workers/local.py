"""The XLA transport: ranks as threads of one process, each on its own device
(TORCH_TPU_CPU_DEVICES=4), in torch_tpu.distributed.local_group. Run by
test_distributed_xla.py: `local.py MODE` prints one "ok ..." line per passing part."""

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import torch_tpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check_collectives  # noqa: E402

torch_tpu.set_fallback("error")
WORLD = 4


def run_ranks(fn, world=WORLD, devices=None, timeout=60, default_group=False):
    """fn(rank, group) on one thread per rank; returns each rank's result or exception.
    `default_group`: each thread's group is its default one (init_local_process_group)."""
    store = dist.HashStore()
    results = [None] * world
    make = torch_tpu.distributed.init_local_process_group if default_group else torch_tpu.distributed.local_group

    def body(r):
        try:
            pg = make(r, world, store, devices=devices, timeout=datetime.timedelta(seconds=timeout))
            results[r] = fn(r, pg)
        except Exception as e:  # noqa: BLE001  (reported per rank)
            results[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3 + 120)  # a hang detector: compiles and imports on a loaded machine come first
        assert not t.is_alive(), "a rank hung"
    return results


def collectives():
    results = run_ranks(lambda r, pg: check_collectives(r, WORLD, pg, device=f"tpu:{r}"))
    for r, res in enumerate(results):
        if isinstance(res, Exception):
            raise res
    m = torch_tpu.metrics()
    assert m["dist_staged_bytes"] == 0 and m["dist_xla_collectives"] > 0, m
    print(f"ok collectives: {len(results[0])} checks on each of {WORLD} ranks, "
          f"{m['dist_xla_collectives']} XLA collectives, {m['dist_xla_bytes']} bytes", flush=True)

    # A sub-group: 2 ranks on tpu:1 and tpu:3.
    def pair(r, pg):
        t = torch.full((3,), float(r + 1), device=f"tpu:{[1, 3][r]}")
        dist.all_reduce(t, group=pg)
        return t.cpu()

    results = run_ranks(pair, world=2, devices=[1, 3])
    for res in results:
        assert torch.equal(res, torch.full((3,), 3.0)), res
    print("ok sub-group on tpu:1 and tpu:3", flush=True)


def failures():
    # A rank that never reaches the collective: the others raise within the timeout, naming it.
    def absent(r, pg):
        if r == 2:
            return "skipped"
        dist.all_reduce(torch.ones(4, device=f"tpu:{r}"), group=pg)

    t0 = time.time()
    results = run_ranks(absent, timeout=3)
    took = time.time() - t0
    for r in (0, 1, 3):
        assert isinstance(results[r], RuntimeError) and "rank(s) 2 of 4 did not reach it" in str(results[r]), results
    assert took < 30, took
    print(f"ok absent rank: named in {took:.1f} s", flush=True)

    # Mismatched shapes: every rank raises and says what each rank passed.
    def mismatch(r, pg):
        dist.all_reduce(torch.ones(4 + (r == 1), device=f"tpu:{r}"), group=pg)

    for res in run_ranks(mismatch, timeout=20):
        assert isinstance(res, RuntimeError) and "different tensors on different ranks" in str(res), res
        assert "rank 1: Float[5]" in str(res), res
    print("ok mismatched shapes", flush=True)

    # Mismatched dtypes.
    def dtypes(r, pg):
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if r else torch.int64, device=f"tpu:{r}"), group=pg)

    for res in run_ranks(dtypes, timeout=20):
        assert isinstance(res, RuntimeError) and "rank 0: Long[4]" in str(res), res
    print("ok mismatched dtypes", flush=True)

    # A tensor on another rank's device.
    def wrong_device(r, pg):
        dist.all_reduce(torch.ones(4, device="tpu:0"), group=pg)

    results = run_ranks(wrong_device, timeout=5)
    assert isinstance(results[1], ValueError) and "rank 1 runs on tpu:1" in str(results[1]), results
    print("ok tensor on the wrong device", flush=True)

    # A receive whose sender never comes: wait() raises after the group's timeout.
    def lonely(r, pg):
        if r == 1:
            work = dist.irecv(torch.zeros(2, device="tpu:1"), group=pg, group_src=0)
            work.wait()

    results = run_ranks(lonely, timeout=2)
    assert isinstance(results[1], RuntimeError) and "recv from rank 0 did not complete" in str(results[1]), results
    print("ok receive without a sender", flush=True)

    # Bad arguments to local_group itself.
    import pytest

    store = dist.HashStore()
    for kwargs, text in [
        (dict(rank=0, world_size=2, store=None), "pass the dist.HashStore"),
        (dict(rank=0, world_size=2, store=store, devices=[1, 1]), "2 distinct devices"),
        (dict(rank=2, world_size=2, store=store), "rank 2 is not in"),
        (dict(rank=0, world_size=2, store=store, devices=[0, 9]), "tpu:9 does not exist"),
    ]:
        with pytest.raises(ValueError, match=text):
            torch_tpu.distributed.local_group(**kwargs)
    print("ok local_group arguments", flush=True)

    # Groups made as for torchrun's processes (no device given): each rank binds the device
    # of its first collective, and the ranks learn each other's from the arrival records.
    def unbound(world, device_of):
        store = dist.HashStore()
        results = [None] * world

        def body(r):
            try:
                backend = torch_tpu._C._tpu_dist_xla_backend(store, r, world, datetime.timedelta(seconds=10), -1)
                pg = dist.ProcessGroup(store, r, world)
                pg._register_backend(torch.device("tpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
                pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
                t = torch.full((3,), float(r + 1), device=device_of(r))
                pg.allreduce([t]).wait()
                got = torch.zeros(3, device=device_of(r))
                peer = (r + 1) % world
                (pg.send([t * (r + 1)], peer, 0) if r == 0 else pg.recv([got], r - 1, 0)).wait()
                results[r] = (t.cpu().tolist(), got.cpu().tolist())
            except Exception as e:  # noqa: BLE001
                results[r] = e

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a rank hung"
        return results

    results = unbound(2, lambda r: f"tpu:{3 - r}")
    assert results == [([3.0] * 3, [0.0] * 3), ([3.0] * 3, [3.0] * 3)], results
    print("ok ranks bind their first collective's device", flush=True)
    for res in unbound(2, lambda r: "tpu:1"):
        assert isinstance(res, ValueError) and "ranks 0 and 1 are on the same device" in str(res), res
    print("ok two ranks on one device", flush=True)

    # After all that, the devices still work.
    results = run_ranks(lambda r, pg: dist.all_reduce(torch.ones(2, device=f"tpu:{r}"), group=pg) or "done")
    assert results == ["done"] * WORLD, results
    print("ok group after failures", flush=True)


def comm():
    """torch.tpu.comm over 4 devices against the same computation on the host."""
    import pytest

    C = torch.tpu.comm
    devs = list(range(WORLD))
    torch_tpu.reset_metrics()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        gen = torch.Generator().manual_seed(0)
        host = [(torch.randn(3, 5, generator=gen) * 8).to(dtype) for _ in devs]
        xs = [h.to(f"tpu:{d}") for h, d in zip(host, devs)]
        exact = dict(rtol=0, atol=0)

        out = C.broadcast(xs[1], devices=[1, 0, 3])
        assert out[0] is xs[1] and [o.device.index for o in out] == [1, 0, 3]
        for o in out:
            torch.testing.assert_close(o.cpu(), host[1], **exact)
        targets = [torch.empty(3, 5, dtype=dtype, device=f"tpu:{d}") for d in (2, 3)]
        C.broadcast(xs[0], out=targets)
        for o in targets:
            torch.testing.assert_close(o.cpu(), host[0], **exact)

        extra = torch.arange(7, device="tpu:0").to(dtype)
        copies = C.broadcast_coalesced([xs[0], extra, xs[0][1]], devs, buffer_size=64)
        assert copies[0][0] is xs[0]
        for d, per in zip(devs, copies):
            assert all(t.device.index == d for t in per)
            torch.testing.assert_close(per[1].cpu(), extra.cpu(), **exact)
            torch.testing.assert_close(per[2].cpu(), host[0][1], **exact)

        want = host[0].double() + host[1].double() + host[2].double() + host[3].double()
        for dest in (2, None, "cpu"):
            got = C.reduce_add(xs, destination=dest)
            where = "cpu" if dest == "cpu" else f"tpu:{0 if dest is None else dest}"
            assert str(got.device) == where, (got.device, where)
            torch.testing.assert_close(got.cpu().double(), want, rtol=1.6e-2, atol=16 * WORLD * torch.finfo(torch.float32).eps)
        sums = C.reduce_add_coalesced([[x, x[0]] for x in xs], destination=3)
        assert sums[0].device.index == 3 and sums[1].shape == (5,)
        torch.testing.assert_close(sums[1].cpu().double(), want[0], rtol=1.6e-2, atol=1e-3)

        for source in (xs[2], host[2]):
            parts = C.scatter(source, devices=[2, 0, 1], chunk_sizes=[2, 0, 3], dim=1)
            assert [p.device.index for p in parts] == [2, 0, 1] and [p.shape[1] for p in parts] == [2, 0, 3]
            torch.testing.assert_close(torch.cat([p.cpu() for p in parts], 1), host[2], **exact)
        parts = C.scatter(xs[0], devices=devs, dim=0)  # 3 rows over 4 devices: 3 chunks, as on CUDA
        assert [p.device.index for p in parts] == [0, 1, 2]
        torch.testing.assert_close(torch.cat([p.cpu() for p in parts]), host[0], **exact)

        for dest in (3, None, "cpu"):
            got = C.gather(xs, dim=1, destination=dest)
            where = "cpu" if dest == "cpu" else f"tpu:{0 if dest is None else dest}"
            assert str(got.device) == where and got.shape == (3, 20)
            torch.testing.assert_close(got.cpu(), torch.cat(host, 1), **exact)
        uneven = [xs[0], xs[1][:1], xs[2][:0], xs[3]]
        got = C.gather(uneven, dim=0, destination=1)
        torch.testing.assert_close(got.cpu(), torch.cat([h.cpu() for h in uneven]), **exact)
    m = torch_tpu.metrics()
    assert m["dist_xla_collectives"] > 0 and m["dist_staged_bytes"] == 0, m
    print(f"ok comm: {m['dist_xla_collectives']} XLA collectives", flush=True)

    x = torch.ones(2, device="tpu:0")
    for call, exc, text in [
        (lambda: C.broadcast(x, devices=[0, 0]), ValueError, "devices repeat"),
        (lambda: C.broadcast(x, devices=[0, 9]), ValueError, "tpu:9 does not exist"),
        (lambda: C.broadcast(x), RuntimeError, "exactly one of"),
        (lambda: C.reduce_add([x, torch.ones(3, device="tpu:1")]), ValueError, "shapes differ"),
        (lambda: C.reduce_add([x, x.clone()]), ValueError, "devices repeat"),
        (lambda: C.reduce_add([x, torch.ones(2)]), ValueError, "expected tpu tensors"),
        (lambda: C.scatter(x, devices=[0, 1], chunk_sizes=[1, 2]), ValueError, "do not split"),
        (lambda: C.gather([x, torch.ones(2, 2, device="tpu:1")], dim=1), ValueError, "every dimension"),
        (lambda: C.broadcast_coalesced([x, torch.ones(1, device="tpu:1")], [0, 1]), RuntimeError, "must be on tpu:0"),
    ]:
        with pytest.raises(exc, match=text):
            call()
    print("ok comm errors", flush=True)


if __name__ == "__main__":
    assert torch.tpu.device_count() >= WORLD, "run with TORCH_TPU_CPU_DEVICES=4"
    {"collectives": collectives, "failures": failures, "comm": comm}[sys.argv[1]]()
