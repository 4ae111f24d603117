#!/usr/bin/env python3
"""Collective bandwidth as the NCCL tests report it: tpu_dist (tpu tensors, staged through the
host) next to gloo on CPU tensors of the same sizes, side by side in one run, 2 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/collectives.py \\
        [--max-mb 64] [--rounds 9] [--markdown docs/distributed_bandwidth.md]

algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and
reduce_scatter (bytes: the larger of input and output). Each size is timed in rounds that
alternate the two transports (and which goes first); the median round is reported, with the
range of the rounds' ratios, then the median ratio per op and its worst size.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    busbw_factors, collective_args, median_ratio_line, message_sizes, provenance, provenance_lines, write_markdown)

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
            # Blocks of about 0.1 s or more: a scheduler slice (a few ms on this 2-core machine)
            # that falls on one call then moves a block's mean by a few percent, not twice.
            iters = max(5, min(500, (32 << 20) // nbytes))
            secs = {"cpu": [], "tpu": []}
            # Blocks of `iters` calls, gloo and tpu_dist in turns (which goes first alternates), so
            # a slow spell of the shared machine falls on both.
            for i in range(args.rounds):
                for dev in (("cpu", "tpu") if i % 2 == 0 else ("tpu", "cpu")):
                    secs[dev].append(run(op, dev, nbytes, n, iters))
            med = {d: statistics.median(v) for d, v in secs.items()}
            row = {"op": op, "bytes": nbytes}
            for d in ("cpu", "tpu"):
                algbw = nbytes / med[d] / 1e9
                row[d] = (med[d] * 1e6, algbw, algbw * factor[op])
            row["ratio"] = med["tpu"] / med["cpu"]
            per_round = [t / c for c, t in zip(secs["cpu"], secs["tpu"])]
            row["low"], row["high"] = min(per_round), max(per_round)
            rows.append(row)
            if rank == 0:
                print(f"{op:15s} {nbytes:>10d} B  gloo {row['cpu'][0]:9.1f} us {row['cpu'][2]:6.2f} GB/s busbw   "
                      f"tpu_dist {row['tpu'][0]:9.1f} us {row['tpu'][2]:6.2f} GB/s busbw   time x{row['ratio']:.2f} "
                      f"({row['low']:.2f}-{row['high']:.2f})", flush=True)
    if rank == 0:
        for line in summary(rows):
            print(line)
    if rank == 0 and args.markdown:
        lines = ["# Collective bandwidth: tpu_dist (staged through the host) and gloo", "",
                 "Written by `benchmarks/collectives.py` (2 processes, this machine); NCCL-tests"
                 " conventions: algbw = bytes / time, busbw = algbw x 2(n-1)/n (all_reduce) or"
                 " (n-1)/n. Each size is timed in blocks of calls, gloo (CPU tensors) and tpu_dist"
                 " (tpu tensors) in turns, " + str(args.rounds) + " blocks each; the times are"
                 " the median blocks'. `time x` is tpu_dist's time over gloo's; `range` the lowest"
                 " and highest of the blocks' ratios (block i of one against block i of the other).",
                 "", *provenance_lines(provenance()), "",
                 "| op | bytes | gloo (us) | gloo busbw (GB/s) | tpu_dist (us) | tpu_dist busbw (GB/s) | time x "
                 "| range |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|",
                 *(f"| {r['op']} | {r['bytes']} | {r['cpu'][0]:.1f} | {r['cpu'][2]:.3f} | {r['tpu'][0]:.1f} | "
                   f"{r['tpu'][2]:.3f} | {r['ratio']:.2f} | {r['low']:.2f}-{r['high']:.2f} |" for r in rows),
                 "", *summary(rows)]
        write_markdown(args.markdown, lines)
    dist.destroy_process_group()


def summary(rows):
    """The median time ratio over every size, then per op with its worst size."""
    lines = [median_ratio_line("tpu_dist / gloo", [r["ratio"] for r in rows]), ""]
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        worst = max(mine, key=lambda r: r["ratio"])
        ratios = [r["ratio"] for r in mine]
        lines.append(f"- {op}: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x,"
                     f" worst at {worst['bytes']} bytes")
    return lines


if __name__ == "__main__":
    main()
