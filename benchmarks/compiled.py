#!/usr/bin/env python3
"""torch.compile(backend="tpu") against strict eager, fused eager, PyTorch's CPU eager and
torch.compile with inductor on the CPU (or, with --ref cuda, PyTorch's CUDA device), in one run: the GPT training step (model and
optimizer step compiled; AdamW(capturable=True) for the tpu backend) and GPT inference (a
forward pass). Every configuration is set up and warmed up first (the first call's time is
reported: it compiles, or loads from the disk cache); then the configurations are timed in
turns, several rounds, and each reports its median.

    python benchmarks/compiled.py [--steps 20] [--rounds 5] [--ref cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from common import interleaved, mode_configs, provenance, ratio_summary, sync, write_json

import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import GPT


def setup(device, compiled, tok, tokens, args):
    torch.manual_seed(0)
    model = GPT(tok.vocab_size, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                dropout=0.0).to(device)
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
    """Builds and warms up one configuration; returns (step, first-call seconds)."""
    with torch_tpu.mode(mode):
        model, opt, fwd, opt_step, data = setup(device, compiled, tok, tokens, args)
        batches_ = itertools.cycle(data)

        def step():
            x, y = next(batches_)
            _, loss = fwd(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt_step()
            return loss.item()

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            step()
        sync(device)
    return step, first


def infer(device, mode, compiled, tok, tokens, args):
    with torch_tpu.mode(mode), torch.no_grad():
        model, _, fwd, _, data = setup(device, compiled, tok, tokens, args)
        model.eval()
        xs = itertools.cycle([x.to(device) for x, _ in data])

        def step():
            with torch.no_grad():
                return fwd(next(xs))[0].sum().item()

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            step()
    return step, first


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The timing and GPT-batch options `setup` reads (compiled_phases.py uses them too)."""
    # 100 calls a round: with 20, single rounds of the training step ranged 1.62-2.22x compiled / strict
    # on this shared 2-core machine; with 100, 1.82-1.92x (the medians agreed).
    ap.add_argument("--steps", type=int, default=100, help="calls per configuration per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--ref", default="cpu", help="the device PyTorch itself runs on, next to tpu: cpu or cuda")


def main(argv=None):
    ap = argparse.ArgumentParser()
    add_run_args(ap)
    ap.add_argument("--task", choices=("train", "infer", "both"), default="both")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    CONFIGS = mode_configs(args.ref)
    text = load_corpus()
    tok = CharTokenizer(text)
    tokens = tok.encode_tensor(text)
    torch._dynamo.reset()
    rows, ratios = [], {}
    tasks = [("GPT training step", train), ("GPT inference (forward)", infer)]
    tasks = [t for t in tasks if args.task == "both" or t[1].__name__ == args.task]
    for task, fn in tasks:
        runs, firsts, errors = {}, {}, {}
        for name, device, mode, compiled in CONFIGS:
            try:
                step, firsts[name] = fn(device, mode, compiled, tok, tokens, args)
                print(f"ready: {task}, {name}, first call {firsts[name]:.1f} s", flush=True)
                runs[name] = (step, lambda m=mode: torch_tpu.mode(m), device)
            except Exception as e:  # noqa: BLE001 - a failing configuration is reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        secs = interleaved(runs, args.steps, args.rounds)
        tokens_per_call = args.batch * args.block
        for name, *_ in CONFIGS:
            if name in errors:
                r = {"error": errors[name]}
            else:
                r = {"tokens_per_s": tokens_per_call / statistics.median(secs[name]), "first_s": firsts[name],
                     "rounds_s": secs[name]}
            r.update(task=task, config=name)
            rows.append(r)
            print(f"{task:26s} {name:34s} " + (f"{r['tokens_per_s']:10.0f} tokens/s  first {r['first_s']:.2f} s"
                                               if "error" not in r else r["error"]), flush=True)
        comp = CONFIGS[2][0]
        if comp in secs:
            ratios[task] = {other: ratio_summary(secs[comp], secs[other])
                            for other in (CONFIGS[0][0], CONFIGS[4][0]) if other in secs}
            for other, rs in ratios[task].items():
                print(f"{task}: compiled / {other} {rs['ratio']:.2f}x (rounds {rs['low']:.2f}-{rs['high']:.2f}x)")
    out = {"provenance": provenance(), "rows": rows, "ratios": ratios, "steps": args.steps, "rounds": args.rounds,
           "model": {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "batch", "block")},
           "graphs": torch_tpu.compiled_graphs()}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
