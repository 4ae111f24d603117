#!/usr/bin/env python3
"""GPT training-step throughput (tokens/s) on tpu (strict eager) next to the
CPU device, side by side in one run, plus the first-step (compile) time.

    python benchmarks/gpt_train.py [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

from common import provenance, sync, write_json

import torch

from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import GPT


def run(device: str, tok, tokens, args) -> dict:
    torch.manual_seed(0)
    model = GPT(tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd, dropout=0.0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    data = list(batches(tokens, args.block_size, args.batch_size, gen, steps=args.warmup + args.steps))

    def step(x, y):
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    t0 = time.perf_counter()
    step(*data[0])
    sync(device)
    first = time.perf_counter() - t0
    for x, y in data[1:args.warmup]:
        step(x, y)
    sync(device)
    t0 = time.perf_counter()
    for x, y in data[args.warmup:]:
        loss = step(x, y)
    loss = loss.item()
    elapsed = time.perf_counter() - t0
    toks = args.steps * args.batch_size * args.block_size
    return {"device": device, "tokens_per_s": toks / elapsed, "step_ms": elapsed / args.steps * 1e3,
            "first_step_s": first, "final_loss": loss}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tok = CharTokenizer(load_corpus())
    tokens = tok.encode_tensor(load_corpus())
    results = [run("cpu", tok, tokens, args), run("tpu", tok, tokens, args)]
    for r in results:
        print(f"{r['device']:4s} {r['tokens_per_s']:10.0f} tokens/s  {r['step_ms']:7.1f} ms/step  "
              f"first step {r['first_step_s']:.2f} s  loss {r['final_loss']:.4f}", flush=True)
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"tpu/cpu throughput: {ratio:.2f}x")
    out = {"provenance": provenance(), "config": vars(args), "results": results, "ratio": ratio}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
