#!/usr/bin/env python3
"""The cost of a custom kernel per call: a Pallas kernel (interpret mode) and a C++ FFI kernel
against the same computation written in PyTorch ops, all on tpu, side by side in one run.

    python benchmarks/kernels.py [--write docs/kernels_benchmark.md] [--json out.json]

Cases: RMSNorm [rows, hidden] (Pallas vs PyTorch ops), a fused AdamW update [n, n] (FFI vs
PyTorch ops), and attention [1, heads, L, 64] (Pallas flash attention vs
F.scaled_dot_product_attention). Each in strict eager (a program per call) and fused eager
(the call inside a program with a neighbouring op). PyTorch's CPU eager is listed for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

from common import interleaved, provenance, provenance_lines, write_json

import torch_tpu  # noqa: E402
from torch_tpu import kernels  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "kernels"))
sys.path.insert(0, os.path.join(REPO, "examples", "kernels", "ffi_adamw"))


def rms_torch(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def adamw_torch(p, g, m, v, h):
    lr, b1, b2, eps, wd, step = h.unbind()
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr / (1 - b1**step) * m / (v.sqrt() / (1 - b2**step).sqrt() + eps), m, v


def cases(rows, hidden, n, heads, length):
    import build
    import pallas_kernels as pk

    rms = kernels.jax_op(pk.rms_norm, name="bench_rms_norm", backward=None)
    flash = kernels.jax_op(lambda q, k, v: pk.flash_attention(q, k, v, causal=True), name="bench_flash",
                           backward=None)
    lib = build.build(os.path.join(tempfile.gettempdir(), "torch_tpu_bench_adamw"))
    adamw = kernels.ffi_op("bench_adamw", "torch_tpu_bench_adamw", library=lib, symbol="TorchTpuExampleAdamW",
                           out_shape=lambda p, *rest: [(p.shape, p.dtype)] * 3)

    def on(device):
        torch.manual_seed(0)
        x, w = torch.randn(rows, hidden, device=device), torch.randn(hidden, device=device)
        p, g, m, v = (torch.randn(n, n, device=device) for _ in range(4))
        v = v.abs()
        h = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.01, 3.0], device=device)
        q, k, vv = (torch.randn(1, heads, length, 64, device=device) for _ in range(3))
        return x, w, p, g, m, v, h, q, k, vv

    tpu, cpu = on("tpu"), on("cpu")
    # The neighbour (a scale) is what fused eager puts in the same program.
    return [
        (f"RMSNorm [{rows}, {hidden}]", "Pallas (interpret)", lambda a=tpu: rms(a[0] * 2, a[1]),
         lambda a=tpu: rms_torch(a[0] * 2, a[1]), lambda a=cpu: rms_torch(a[0] * 2, a[1])),
        (f"AdamW update [{n}, {n}]", "C++ FFI", lambda a=tpu: adamw(a[2] * 1, *a[3:7])[0],
         lambda a=tpu: adamw_torch(a[2] * 1, *a[3:7])[0], lambda a=cpu: adamw_torch(a[2] * 1, *a[3:7])[0]),
        (f"causal attention [1, {heads}, {length}, 64]", "Pallas flash (interpret)",
         lambda a=tpu: flash(a[7] * 1, a[8], a[9]),
         lambda a=tpu: F.scaled_dot_product_attention(a[7] * 1, a[8], a[9], is_causal=True),
         lambda a=cpu: F.scaled_dot_product_attention(a[7] * 1, a[8], a[9], is_causal=True)),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", help="markdown file to write the results to")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch_tpu.set_fallback("error")
    prov = provenance()
    rows = []
    for name, kind, kernel, torch_ops, cpu_ops in cases(args.rows, args.hidden, args.n, args.heads, args.length):
        runs = {}
        for mode in ("strict", "fused"):
            runs[f"kernel {mode}"] = (kernel, lambda m=mode: torch_tpu.mode(m), "tpu")
            runs[f"ops {mode}"] = (torch_ops, lambda m=mode: torch_tpu.mode(m), "tpu")
        runs["cpu"] = (cpu_ops, lambda: torch_tpu.mode("strict"), "cpu")
        for fn, ctx, _ in runs.values():  # warm-up: lowering and compiles
            with ctx():
                fn()
                fn()
        t = interleaved(runs, args.steps, args.rounds)
        us = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        rows.append({"case": name, "kernel": kind, **{k.replace(" ", "_") + "_us": v for k, v in us.items()},
                     "strict_ratio": us["kernel strict"] / us["ops strict"],
                     "fused_ratio": us["kernel fused"] / us["ops fused"]})
        print(rows[-1], flush=True)
    lines = [
        "# Custom kernels: cost per call",
        "",
        "Generated by `python benchmarks/kernels.py --write docs/kernels_benchmark.md`. Microseconds per",
        f"call (median of {args.rounds} interleaved rounds of {args.steps} calls, device work included), the",
        "kernel against the same computation in PyTorch ops, both on tpu (CPU plugin); kernel / ops",
        "above 1 means the kernel is slower. PyTorch CPU eager for scale.",
        "",
        *provenance_lines(prov),
        "",
        "| case | kernel | kernel strict | ops strict | kernel / ops | kernel fused | ops fused | kernel / ops |"
        " CPU eager |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['kernel']} | {r['kernel_strict_us']:.0f} | {r['ops_strict_us']:.0f} | "
                     f"{r['strict_ratio']:.2f}x | {r['kernel_fused_us']:.0f} | {r['ops_fused_us']:.0f} | "
                     f"{r['fused_ratio']:.2f}x | {r['cpu_us']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    write_json(args.json, {"provenance": prov, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
