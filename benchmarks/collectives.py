#!/usr/bin/env python3
"""Collective bandwidth as the NCCL tests report it: tpu_dist (tpu tensors, staged through the
host) next to gloo on CPU tensors of the same sizes, side by side in one run, 2 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/collectives.py \\
        [--max-mb 64] [--markdown docs/distributed_bandwidth.md]

algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and
reduce_scatter (bytes: the larger of input and output). Each size is timed in rounds that
alternate the two transports; the median round is reported.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import busbw_factors, collective_args, message_sizes, write_collective_report  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tpu  # noqa: E402


def run(op, device, nbytes, n, iters):
    numel = max(1, nbytes // 4)
    if op == "all_reduce":
        t = torch.ones(numel, device=device)

        def fn():
            dist.all_reduce(t)
    elif op == "all_gather":
        part = max(1, numel // n)
        inp, out = torch.ones(part, device=device), torch.empty(part * n, device=device)

        def fn():
            dist.all_gather_into_tensor(out, inp)
    else:
        part = max(1, numel // n)
        inp, out = torch.ones(part * n, device=device), torch.empty(part, device=device)

        def fn():
            dist.reduce_scatter_tensor(out, inp)
    fn()
    if device == "tpu":
        torch.tpu.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "tpu":
        torch.tpu.synchronize()
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    args = collective_args(argv, max_mb=64)
    dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = message_sizes(args.max_mb)
    factor = busbw_factors(n)
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes in sizes:
            iters = max(3, min(200, (8 << 20) // nbytes))
            secs = {"cpu": [], "tpu": []}
            for _ in range(args.rounds):
                for dev in ("cpu", "tpu"):
                    secs[dev].append(run(op, dev, nbytes, n, iters))
            med = {d: statistics.median(v) for d, v in secs.items()}
            row = {"op": op, "bytes": nbytes}
            for d in ("cpu", "tpu"):
                algbw = nbytes / med[d] / 1e9
                row[d] = (med[d] * 1e6, algbw, algbw * factor[op])
            row["ratio"] = med["tpu"] / med["cpu"]
            rows.append(row)
            if rank == 0:
                print(f"{op:15s} {nbytes:>10d} B  gloo {row['cpu'][0]:9.1f} us {row['cpu'][2]:6.2f} GB/s busbw   "
                      f"tpu_dist {row['tpu'][0]:9.1f} us {row['tpu'][2]:6.2f} GB/s busbw   time x{row['ratio']:.2f}",
                      flush=True)
    if rank == 0 and args.markdown:
        write_collective_report(
            args.markdown,
            ["# Collective bandwidth: tpu_dist (staged through the host) and gloo", "",
             "Written by `benchmarks/collectives.py` (2 processes, this machine); NCCL-tests"
             " conventions: algbw = bytes / time, busbw = algbw x 2(n-1)/n (all_reduce) or"
             " (n-1)/n. `time x` is tpu_dist's time over gloo's on the same sizes, in one run."],
            ["| op | bytes | gloo (us) | gloo busbw (GB/s) | tpu_dist (us) | tpu_dist busbw (GB/s) | time x |",
             "|---|---:|---:|---:|---:|---:|---:|"], rows,
            lambda r: (f"| {r['op']} | {r['bytes']} | {r['cpu'][0]:.1f} | {r['cpu'][2]:.3f} | {r['tpu'][0]:.1f} | "
                       f"{r['tpu'][2]:.3f} | {r['ratio']:.2f} |"), "tpu_dist / gloo")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
