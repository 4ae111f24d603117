#!/usr/bin/env python3
"""The project's main job: train the small character-level GPT on
data/corpus.txt on the tpu device, then (by default) the same steps with the
same seed on the CPU, and print a side-by-side summary and the tpu metrics.

    python scripts/train_gpt.py [--steps 100] [--batch-size 16] [--block-size 64]
                                [--device tpu] [--no-compare-cpu] [--autocast bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_tpu  # noqa: E402
from torch_tpu.data import CharTokenizer, batches, load_corpus  # noqa: E402
from torch_tpu.models import GPT, train_steps  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the small GPT on data/corpus.txt (tpu vs cpu).")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm")
    ap.add_argument("--act", choices=["gelu", "silu"], default="gelu")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="tpu")
    ap.add_argument("--compare-cpu", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the same steps on the CPU device (default: on)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--mode", choices=["strict", "debug"], default=None, help="torch_tpu execution mode")
    ap.add_argument("--fallback", choices=["warn", "error"], default=None, help="torch_tpu CPU-fallback policy")
    ap.add_argument("--sample", type=int, default=0, help="generate this many characters after training")
    ap.add_argument("--corpus", default=None, help="text file (default: data/corpus.txt)")
    return ap.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "tpu":
        torch.tpu.synchronize()


def run(args, device: torch.device, tokens: torch.Tensor, tok: CharTokenizer) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd, dropout=args.dropout, norm=args.norm, act=args.act).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(tokens, args.block_size, args.batch_size, gen)
    tok_per_step = args.batch_size * args.block_size
    print(f"\n== {device}: GPT {model.num_params() / 1e6:.3f}M params, vocab {tok.vocab_size}, "
          f"batch {args.batch_size}x{args.block_size}, {args.steps} steps"
          f"{', autocast bf16' if args.autocast == 'bf16' else ''}", flush=True)

    state = {"t_last": None, "step_last": -1, "t_first": None}
    _sync(device)
    t0 = time.perf_counter()

    def log(step: int, loss: torch.Tensor) -> None:
        if step == 0:
            float(loss)  # first step includes compilation: time it separately
            state["t_first"] = time.perf_counter()
            state["t_last"], state["step_last"] = state["t_first"], 0
            print(f"step {step + 1:5d}  loss {float(loss):.4f}  first step {state['t_first'] - t0:.2f}s",
                  flush=True)
        elif (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            value = float(loss)  # host read: waits for the device
            now = time.perf_counter()
            tps = (step - state["step_last"]) * tok_per_step / max(now - state["t_last"], 1e-9)
            state["t_last"], state["step_last"] = now, step
            print(f"step {step + 1:5d}  loss {value:.4f}  {tps:10.0f} tokens/s", flush=True)

    losses = train_steps(model, data, opt, args.steps, clip=args.clip,
                         autocast_dtype=torch.bfloat16 if args.autocast == "bf16" else None,
                         device=device, callback=log)
    _sync(device)
    t_end = time.perf_counter()
    total = t_end - t0
    steady = t_end - state["t_first"] if args.steps > 1 else total
    steady_tps = (args.steps - 1) * tok_per_step / steady if args.steps > 1 else float("nan")
    res = {
        "device": str(device),
        "losses": losses,
        "final_loss": losses[-1],
        "first_step_s": state["t_first"] - t0,
        "total_s": total,
        "tokens_per_s": steady_tps,
        "tokens_per_s_total": args.steps * tok_per_step / total,
    }
    print(f"{device}: final loss {res['final_loss']:.4f}, {total:.2f}s total "
          f"(first step {res['first_step_s']:.2f}s), {steady_tps:.0f} tokens/s after the first step", flush=True)
    if args.sample > 0:
        prompt = torch.tensor([tok.encode("\n")], dtype=torch.long, device=device)
        out = model.generate(prompt, args.sample, greedy=True)
        print(f"sample ({device}, greedy):\n{tok.decode(out[0].cpu())}", flush=True)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode:
        torch_tpu.set_mode(args.mode)
    if args.fallback:
        torch_tpu.set_fallback(args.fallback)
    text = load_corpus(args.corpus)
    tok = CharTokenizer(text)
    tokens = torch.tensor(tok.encode(text), dtype=torch.long)
    print(f"corpus: {len(text)} characters, vocab {tok.vocab_size}; torch {torch.__version__}; "
          f"tpu device: {torch.tpu.get_device_name() if torch.tpu.is_available() else 'unavailable'}")

    device = torch.device(args.device)
    results = [run(args, device, tokens, tok)]
    if args.compare_cpu and device.type != "cpu":
        results.append(run(args, torch.device("cpu"), tokens, tok))

    if len(results) == 2:
        a, b = results
        diffs = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
        print("\n== summary")
        print(f"{'':24s}{a['device']:>14s}{b['device']:>14s}")
        print(f"{'final loss':24s}{a['final_loss']:14.4f}{b['final_loss']:14.4f}")
        print(f"{'tokens/s (steady)':24s}{a['tokens_per_s']:14.0f}{b['tokens_per_s']:14.0f}")
        print(f"{'tokens/s (incl. first)':24s}{a['tokens_per_s_total']:14.0f}{b['tokens_per_s_total']:14.0f}")
        print(f"{'first step (s)':24s}{a['first_step_s']:14.2f}{b['first_step_s']:14.2f}")
        print(f"{'total (s)':24s}{a['total_s']:14.2f}{b['total_s']:14.2f}")
        ratio = a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else float("nan")
        print(f"throughput ratio {a['device']}/{b['device']}: {ratio:.2f}x")
        print(f"max |loss difference| over {len(diffs)} steps: {max(diffs):.2e}"
              f"{' (dropout draws differ between devices)' if args.dropout > 0 else ''}")

    print("\n== torch_tpu metrics")
    print(torch_tpu.metrics_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
