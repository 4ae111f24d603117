#!/usr/bin/env python3
"""torch.compile(backend="tpu") against strict eager, fused eager, PyTorch's CPU eager and
torch.compile with inductor on the CPU, side by side in one run: the GPT training step
(model and optimizer step compiled; AdamW(capturable=True) for the tpu backend) and GPT inference (a forward pass), with the time of
the first (compiling) step.

    python benchmarks/compiled.py [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from common import provenance, sync

import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import GPT


def setup(device, compiled, tok, tokens, args):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tok.vocab_size, block_size=args.block, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to(device)
    # A compiled optimizer step keeps its step counts on the device (capturable), so the
    # graph has no CPU values and its program replays.
    capturable = compiled == "tpu"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)
    fwd, opt_step = model, opt.step
    if compiled:
        fwd = torch.compile(model, backend=compiled)
        opt_step = torch.compile(opt.step, backend=compiled)
    data = list(batches(tokens, args.block, args.batch, torch.Generator().manual_seed(0),
                        steps=args.steps + args.warmup))
    return model, opt, fwd, opt_step, data


def train(device, mode, compiled, tok, tokens, args):
    with torch_tpu.mode(mode):
        model, opt, fwd, opt_step, data = setup(device, compiled, tok, tokens, args)

        def step(x, y):
            _, loss = fwd(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt_step()
            return loss.item()

        t0 = time.perf_counter()
        step(*data[0])
        first = time.perf_counter() - t0
        for x, y in data[1:args.warmup]:
            step(x, y)
        sync(device)
        t0 = time.perf_counter()
        for x, y in data[args.warmup:]:
            loss = step(x, y)
        elapsed = time.perf_counter() - t0
    return {"tokens_per_s": args.steps * args.batch * args.block / elapsed, "first_s": first, "loss": loss}


def infer(device, mode, compiled, tok, tokens, args):
    with torch_tpu.mode(mode), torch.no_grad():
        model, _, fwd, _, data = setup(device, compiled, tok, tokens, args)
        model.eval()
        xs = [x.to(device) for x, _ in data]
        t0 = time.perf_counter()
        fwd(xs[0])[0].sum().item()
        first = time.perf_counter() - t0
        for x in xs[1:args.warmup]:
            fwd(x)[0].sum().item()
        t0 = time.perf_counter()
        for x in xs[args.warmup:]:
            fwd(x)[0].sum().item()
        elapsed = time.perf_counter() - t0
    return {"tokens_per_s": args.steps * args.batch * args.block / elapsed, "first_s": first}


CONFIGS = [
    ("tpu strict eager", "tpu", "strict", None),
    ("tpu fused eager", "tpu", "fused", None),
    ("tpu torch.compile(backend='tpu')", "tpu", "strict", "tpu"),
    ("CPU eager", "cpu", "strict", None),
    ("CPU torch.compile (inductor)", "cpu", "strict", "inductor"),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    text = load_corpus()
    tok = CharTokenizer(text)
    tokens = tok.encode_tensor(text)
    rows = []
    for task, fn in (("GPT training step", train), ("GPT inference (forward)", infer)):
        for name, device, mode, compiled in CONFIGS:
            try:
                r = fn(device, mode, compiled, tok, tokens, args)
            except Exception as e:  # noqa: BLE001 - a failing configuration is reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            r.update(task=task, config=name)
            rows.append(r)
            print(f"{task:26s} {name:34s} " + (f"{r['tokens_per_s']:10.0f} tokens/s  first {r['first_s']:.2f} s"
                                               if "error" not in r else r["error"]), flush=True)
    out = {"provenance": provenance(), "rows": rows, "graphs": torch_tpu.compiled_graphs()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
