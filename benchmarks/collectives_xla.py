#!/usr/bin/env python3
"""Collective bandwidth of the XLA transport: 4 devices of one process (TORCH_TPU_CPU_DEVICES=4),
as the NCCL tests report it, side by side in one run with gloo over the same 4 ranks.

    TORCH_TPU_CPU_DEVICES=4 python benchmarks/collectives_xla.py [--max-mb 16] \\
        [--markdown docs/distributed_bandwidth_xla.md]

Three columns per size: gloo (4 threads, one rank each, CPU tensors), tpu_dist's XLA transport
(4 threads, one rank and device each: torch_tpu.distributed.local_group) and one launch over
all 4 devices from one thread (what torch.tpu.comm runs). algbw = bytes / time; busbw = algbw x
2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter. Rounds alternate the
three; the median round is reported.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import busbw_factors, collective_args, message_sizes, write_collective_report  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_tpu  # noqa: E402
from torch_tpu import _C  # noqa: E402

N = 4
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _collective(op, device, numel, group):
    part = max(1, numel // N)
    if op == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        inp, out = torch.ones(part, device=device), torch.empty(part * N, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    inp, out = torch.ones(part * N, device=device), torch.empty(part, device=device)
    return lambda: dist.reduce_scatter_tensor(out, inp, group=group)


def ranks(op, kind, nbytes, iters):
    """Seconds per collective with N ranks as threads ("gloo" or "xla")."""
    store = dist.HashStore()
    start, stop = threading.Barrier(N), threading.Barrier(N)
    took = [0.0] * N
    timeout = datetime.timedelta(seconds=300)

    def body(r):
        # local_group sends CPU tensors to gloo and tpu tensors to the XLA transport.
        group = torch_tpu.distributed.local_group(r, N, store, timeout=timeout)
        device = "cpu" if kind == "gloo" else f"tpu:{r}"
        fn = _collective(op, device, max(1, nbytes // 4), group)
        fn()
        torch_tpu.sync() if device != "cpu" else None
        start.wait()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device != "cpu":
            torch.tpu.synchronize(r)
        stop.wait()
        took[r] = time.perf_counter() - t0

    threads = [threading.Thread(target=body, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(took) / iters


def one_launch(op, nbytes, iters):
    """Seconds per collective as one launch over N devices from this thread."""
    numel = max(1, nbytes // 4)
    part = max(1, numel // N)
    size = {"all_reduce": numel, "all_gather": part, "reduce_scatter": part * N}[op]
    xs = [torch.ones(size, device=f"tpu:{d}") for d in range(N)]
    _C._comm_collective(op, xs)
    torch_tpu.sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        outs = _C._comm_collective(op, xs)
    for d in range(N):
        torch.tpu.synchronize(d)
    del outs
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    args = collective_args(argv, max_mb=16)
    if torch.tpu.device_count() < N:
        raise SystemExit(f"needs {N} devices: run with TORCH_TPU_CPU_DEVICES={N}")
    sizes = message_sizes(args.max_mb)
    factor = busbw_factors(N)
    kinds = ("gloo", "xla", "launch")
    rows = []
    for op in OPS:
        for nbytes in sizes:
            iters = max(3, min(100, (4 << 20) // nbytes))
            secs = {k: [] for k in kinds}
            for _ in range(args.rounds):
                secs["gloo"].append(ranks(op, "gloo", nbytes, iters))
                secs["xla"].append(ranks(op, "xla", nbytes, iters))
                secs["launch"].append(one_launch(op, nbytes, iters))
            med = {k: statistics.median(v) for k, v in secs.items()}
            row = {"op": op, "bytes": nbytes}
            for k in kinds:
                row[k] = (med[k] * 1e6, nbytes / med[k] / 1e9 * factor[op])
            row["ratio"] = med["xla"] / med["gloo"]
            rows.append(row)
            print(f"{op:15s} {nbytes:>9d} B  gloo {row['gloo'][0]:9.1f} us  xla ranks {row['xla'][0]:9.1f} us  "
                  f"one launch {row['launch'][0]:9.1f} us  xla/gloo x{row['ratio']:.2f}", flush=True)
    if args.markdown:
        write_collective_report(
            args.markdown,
            ["# Collective bandwidth: tpu_dist's XLA transport over 4 devices of one process", "",
             "Written by `benchmarks/collectives_xla.py` (`TORCH_TPU_CPU_DEVICES=4`, this machine). gloo and"
             " the XLA transport each run 4 ranks as threads of one process (gloo on CPU tensors, XLA one"
             " device per rank); `one launch` is the same program launched once over the 4 devices from"
             " one thread (torch.tpu.comm). busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n."
             " `xla / gloo` is the XLA ranks' time over gloo's, in one run."],
            ["| op | bytes | gloo (us) | gloo busbw (GB/s) | XLA ranks (us) | XLA busbw (GB/s) | one launch (us) |"
             " one launch busbw (GB/s) | xla / gloo |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"], rows,
            lambda r: (f"| {r['op']} | {r['bytes']} | {r['gloo'][0]:.1f} | {r['gloo'][1]:.3f} | {r['xla'][0]:.1f} | "
                       f"{r['xla'][1]:.3f} | {r['launch'][0]:.1f} | {r['launch'][1]:.3f} | {r['ratio']:.2f} |"),
            "XLA ranks / gloo")


if __name__ == "__main__":
    main()
