#!/usr/bin/env python3
"""Per-op cost in strict eager: microseconds per op on tpu next to PyTorch's CPU
eager, measured side by side in one run. At the default size (64) this is the
per-op overhead; `--throughput` times a wider set of ops at 512x512, where a
lowering that XLA compiles into slow code stands out (pow and topk did).

    python benchmarks/op_overhead.py [--size 64] [--json out.json]
    python benchmarks/op_overhead.py --throughput [--size 512]
"""

from __future__ import annotations

import argparse

from common import provenance, time_per_call, write_json

import torch
import torch.nn.functional as F


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


def throughput_cases(n: int):
    """Ops common in models, on [n, n] float32 (and a few other shapes)."""
    return {
        "add": lambda t: t["a"] + t["b"],
        "gelu": lambda t: F.gelu(t["a"]),
        "silu": lambda t: F.silu(t["a"]),
        "pow 2 (x ** 2)": lambda t: t["a"] ** 2,
        "pow 2.5": lambda t: t["p"] ** 2.5,
        "sum over last dim": lambda t: t["a"].sum(-1),
        "amax over last dim": lambda t: t["a"].amax(-1),
        "argmax over last dim": lambda t: t["a"].argmax(-1),
        "cumsum": lambda t: t["a"].cumsum(-1),
        "softmax": lambda t: t["a"].softmax(-1),
        "layer_norm": lambda t: F.layer_norm(t["a"], (n,), t["w"]),
        "rms_norm": lambda t: F.rms_norm(t["a"], (n,), t["w"]),
        "cross_entropy": lambda t: F.cross_entropy(t["a"], t["target"]),
        "matmul": lambda t: t["a"] @ t["b"],
        "attention (sdpa, causal)": lambda t: F.scaled_dot_product_attention(t["q"], t["q"], t["q"], is_causal=True),
        "embedding": lambda t: F.embedding(t["ids"], t["a"]),
        "topk (k=8)": lambda t: t["a"].topk(8, -1).values,
        "sort": lambda t: t["a"].sort(-1).values,
        "transpose + contiguous": lambda t: t["a"].t().contiguous(),
        "where": lambda t: torch.where(t["mask"], t["a"], t["b"]),
        "conv2d 3x3": lambda t: F.conv2d(t["img"], t["kernel"], padding=1),
    }


def throughput_inputs(n: int, device: str):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    t = {"a": a, "b": b, "p": a.abs() + 0.5, "w": torch.randn(n, generator=g), "mask": a > 0,
         "target": torch.randint(0, n, (n,), generator=g), "ids": torch.randint(0, n, (4 * n,), generator=g),
         "q": torch.randn(4, 8, n // 4, 64, generator=g), "img": torch.randn(8, 32, 32, 32, generator=g),
         "kernel": torch.randn(32, 32, 3, 3, generator=g)}
    return {k: v.to(device) for k, v in t.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=None, help="64 (overhead) or 512 (--throughput)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--ref", default="cpu", help="the device PyTorch itself runs on, next to tpu: cpu or cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ref = args.ref
    n = args.size or (512 if args.throughput else 64)
    iters = args.iters or (20 if args.throughput else 200)
    rows = []
    table = throughput_cases(n) if args.throughput else cases(n)
    inputs = {dev: throughput_inputs(n, dev) for dev in (ref, "tpu")} if args.throughput else None
    for name, fn in table.items():
        res = {}
        for dev in (ref, "tpu"):
            # Overhead cases get fresh operands (some write them in place).
            operands = (inputs[dev],) if inputs else (torch.randn(n, n, device=dev), torch.randn(n, n, device=dev))
            res[dev] = time_per_call(lambda: fn(*operands), dev, iters=iters) * 1e6
        rows.append({"op": name, "ref_us": res[ref], "tpu_us": res["tpu"], "ratio": res["tpu"] / res[ref]})
        print(f"{name:28s} {ref} {res[ref]:8.1f} us   tpu {res['tpu']:8.1f} us   tpu/{ref} {res['tpu'] / res[ref]:6.1f}x",
              flush=True)
    out = {"provenance": provenance(), "ref": ref, "size": n, "iters": iters, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
