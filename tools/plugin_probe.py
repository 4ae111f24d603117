#!/usr/bin/env python3
"""Runs common ops one at a time on tpu and compares each with PyTorch on the CPU, printing
the op's name before it runs: on a new PJRT plugin, the last name printed before a crash
is the op that crashed (run with PYTHONFAULTHANDLER=1 for the Python stack).

    TORCH_TPU_PLUGIN=cuda python tools/plugin_probe.py [--only NAME_PART]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_tpu  # noqa: E402,F401


def probes():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g)
    b = torch.randn(8, 16, generator=g)
    i = torch.randint(0, 8, (5,), generator=g)
    return {
        "to and back": lambda d: a.clone().to(d),
        "add": lambda d: a.clone().to(d) + b.to(d),
        "zeros on device": lambda d: torch.zeros(4, 4, device=d),
        "full on device": lambda d: torch.full((3,), 2.5, device=d),
        "arange on device": lambda d: torch.arange(10, device=d),
        "randn on device (shape only)": lambda d: torch.randn(4, 4, device=d).shape,
        "fill_": lambda d: a.clone().to(d).fill_(3.0),
        "zero_ on a view": lambda d: _zero_view(a.clone().to(d)),
        "in-place add_": lambda d: a.clone().to(d).add_(b.to(d)),
        "square": lambda d: a.clone().to(d).square(),
        "pow 2": lambda d: a.clone().to(d).pow(2),
        "sum": lambda d: a.clone().to(d).sum(),
        "sum dim 1": lambda d: a.clone().to(d).sum(1),
        "sum float64": lambda d: a.double().to(d).sum(1),
        "bool any": lambda d: (a.clone().to(d) > 0).any(),
        "int64 add": lambda d: i.to(d) + 1,
        "item": lambda d: torch.tensor(a.sum().item()) if d == "cpu" else torch.tensor(a.clone().to(d).sum().item()),
        "index_select": lambda d: a.clone().to(d).index_select(0, i.to(d)),
        "getitem tensor": lambda d: a.clone().to(d)[i.to(d)],
        "setitem slice": lambda d: _setitem(a.clone().to(d)),
        "sort": lambda d: a.clone().to(d).sort(1).values,
        "topk": lambda d: a.clone().to(d).topk(3).values,
        "matmul": lambda d: a.clone().to(d) @ b.to(d).t(),
        "softmax": lambda d: a.clone().to(d).softmax(-1),
        "transpose contiguous": lambda d: a.clone().to(d).t().contiguous(),
        "cat": lambda d: torch.cat([a.clone().to(d), b.to(d)]),
        "where": lambda d: torch.where(a.clone().to(d) > 0, a.clone().to(d), b.to(d)),
        "float16 add": lambda d: a.half().to(d) + 1,
        "bfloat16 matmul": lambda d: a.bfloat16().to(d) @ b.bfloat16().to(d).t(),
        "backward": lambda d: _grad(a, d),
    }


def _zero_view(t):
    t[:, 2:5].zero_()
    return t


def _setitem(t):
    t[1:3] = 7.0
    return t


def _grad(a, d):
    x = a.detach().clone().to(d).requires_grad_()
    (x.sin() * x).sum().backward()
    return x.grad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    bad = 0
    for name, fn in probes().items():
        if args.only and args.only not in name:
            continue
        print(f"probe: {name} ... ", end="", flush=True)
        try:
            want = fn("cpu")
            got = fn("tpu")
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got.cpu(), want, equal_nan=True)
            else:
                assert got == want, (got, want)
            print("ok", flush=True)
        except Exception as e:  # noqa: BLE001 - every probe reports
            bad += 1
            print(f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
    print(f"probes failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
