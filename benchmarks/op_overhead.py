#!/usr/bin/env python3
"""Per-op overhead in strict eager: microseconds per small op on tpu next to
PyTorch's CPU eager, measured side by side in one run.

    python benchmarks/op_overhead.py [--size 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from common import provenance, time_per_call

import torch


def cases(n: int):
    return {
        "add (a + b)": lambda a, b: a + b,
        "mul by scalar (a * 2.5)": lambda a, b: a * 2.5,
        "relu": lambda a, b: torch.relu(a),
        "sum over dim": lambda a, b: a.sum(1),
        "matmul": lambda a, b: a @ b,
        "softmax": lambda a, b: torch.softmax(a, -1),
        "in-place add_": lambda a, b: a.add_(b),
        "slice view + add": lambda a, b: a[:, : n // 2] + 1,
        "transpose + contiguous": lambda a, b: a.t().contiguous(),
        "index_select": lambda a, b: a.index_select(0, torch.arange(8, device=a.device)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = args.size
    rows = []
    for name, fn in cases(n).items():
        res = {}
        for dev in ("cpu", "tpu"):
            a = torch.randn(n, n, device=dev)
            b = torch.randn(n, n, device=dev)
            res[dev] = time_per_call(lambda: fn(a, b), dev, iters=args.iters) * 1e6
        rows.append({"op": name, "cpu_us": res["cpu"], "tpu_us": res["tpu"], "ratio": res["tpu"] / res["cpu"]})
        print(f"{name:28s} cpu {res['cpu']:8.1f} us   tpu {res['tpu']:8.1f} us   tpu/cpu {res['tpu'] / res['cpu']:6.1f}x",
              flush=True)
    out = {"provenance": provenance(), "size": n, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
