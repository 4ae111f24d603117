"""Failures across ranks must be errors, not hangs. Run by test_distributed.py, one process
per rank (not under torchrun, whose agent would end the survivors when one rank dies).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python failures.py dead|mismatch|barrier
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401

MODE = sys.argv[1]
dist.init_process_group(timeout=datetime.timedelta(seconds=8))  # tpu: tpu_dist
rank = dist.get_rank()
t = torch.ones(4, device="tpu")
dist.all_reduce(t)  # everyone is up
assert t.cpu().tolist() == [2.0] * 4
start = time.monotonic()
try:
    if MODE == "dead":
        if rank == 1:
            os._exit(3)  # dies without a word
        time.sleep(1)
        dist.all_reduce(t)
    elif MODE == "mismatch":
        dist.all_reduce(torch.ones(4 + 64 * rank, device="tpu"))
    elif MODE == "barrier":
        if rank == 1:
            time.sleep(60)  # never arrives in time (the test ends it once rank 0 has raised)
            raise SystemExit(0)
        dist.barrier()
    print(f"rank {rank}: no error", flush=True)
except RuntimeError as e:
    first = " | ".join(str(e).splitlines())[:600]
    print(f"rank {rank}: raised {type(e).__name__} after {time.monotonic() - start:.1f} s: {first}", flush=True)
    os._exit(0)
