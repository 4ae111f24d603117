"""tpu_dist's staged transport (csrc/distributed/staging.cpp): its collectives against gloo on 2
processes (dist_workers/staging.py), and, in this process, its pool of host blocks: reused,
emptied by torch.tpu.empty_cache(), and results that stay valid after it."""

import datetime
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import torch_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_workers")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed")


def _stats():
    return torch_tpu._C._tpu_dist_staging_stats()


def _eventually(cond, seconds=5.0):
    """A block comes back when the plugin lets go of the buffer over it, which may be on its thread."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def one_rank_group():
    dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_pool_is_reused_and_emptied_and_results_outlive_it(one_rank_group):
    t = torch.arange(1 << 16, dtype=torch.float32, device="tpu")

    def step():
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out = torch.empty(1 << 16, device="tpu")
        dist.all_gather_into_tensor(out, t)
        return out

    out = step()  # the blocks a step holds at once (with the last step's result), allocated
    out = step()
    before = _stats()
    for _ in range(4):
        out = step()
    after = _stats()
    assert after["allocations"] == before["allocations"], (before, after)
    assert after["reuses"] >= before["reuses"] + 8, (before, after)
    assert after["zero_copy_results"] >= before["zero_copy_results"] + 8, (before, after)
    assert torch.equal(t.cpu(), torch.arange(1 << 16, dtype=torch.float32))
    assert torch.equal(out.cpu(), t.cpu())

    kept = torch.full((1 << 16,), 3.0, device="tpu")
    dist.all_reduce(kept)
    assert _stats()["cached_blocks"] > 0
    torch.tpu.empty_cache()
    assert _stats()["cached_blocks"] == 0 and _stats()["cached_bytes"] == 0, _stats()
    for _ in range(3):  # fresh blocks, written; `kept` must not see them
        junk = torch.full((1 << 16,), -1.0, device="tpu")
        dist.all_reduce(junk)
    assert torch.equal(kept.cpu(), torch.full((1 << 16,), 3.0))
    assert torch.equal((kept + 1).cpu(), torch.full((1 << 16,), 4.0))
    # Every block comes back once the results over them are gone (in fused eager, already
    # when the copy into `kept` ran: the result is then a buffer of the program's own).
    del kept, junk, t, out
    assert _eventually(lambda: _stats()["blocks_in_use"] == 0), _stats()
    assert _stats()["cached_blocks"] > 0, _stats()


def test_a_result_holds_its_block_until_it_is_freed(one_rank_group):
    if torch_tpu.get_mode() == "fused":
        pytest.skip("fused eager copies a result into a buffer of its own when its graph runs")
    kept = torch.full((1 << 16,), 2.0, device="tpu")
    dist.all_reduce(kept)
    in_use = _stats()["blocks_in_use"]
    assert in_use >= 1, _stats()
    torch.tpu.empty_cache()
    assert _stats()["blocks_in_use"] == in_use
    del kept  # its block goes back to the pool
    assert _eventually(lambda: _stats()["blocks_in_use"] == in_use - 1), (in_use, _stats())


def test_one_rank_results_match_the_cpu(one_rank_group):
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        x = (torch.arange(1000) % 13 - 6).to(dtype)
        t = x.to("tpu")
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t.cpu(), x)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert torch.equal(t.cpu(), x)
        if dtype.is_floating_point:
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
            assert torch.equal(t.cpu(), x * 2)
        out = torch.zeros(1000, dtype=dtype, device="tpu")
        dist.reduce_scatter_tensor(out, x.to("tpu"))
        assert torch.equal(out.cpu(), x)
        dist.broadcast(out, src=0)
        assert torch.equal(out.cpu(), x)


def test_staged_collectives_match_gloo_on_two_ranks():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_TPU_FALLBACK"] = "error"
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(WORKERS, "staging.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # Both ranks ran every check (the count is the worker's: it must not shrink unnoticed).
    done = sorted(re.findall(r"rank (\d): staging ok (\d+) checks", r.stdout))
    assert done == [("0", "221"), ("1", "221")], r.stdout[-3000:]
