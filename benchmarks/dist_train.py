#!/usr/bin/env python3
"""DDP and FSDP2 training throughput on tpu through tpu_dist, at 1 and 2 ranks (each rank a
process with its own batch; tokens/s over all ranks), and the ratio 2 ranks / 1 rank.

    python benchmarks/dist_train.py [--steps 10] [--markdown docs/distributed_training.md]

Run as is, it starts torchrun for each configuration; under torchrun (RANK set) it is the
worker and prints one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(args):
    import torch
    import torch.distributed as dist

    import torch_tpu  # noqa: F401
    from torch_tpu.models import GPT

    dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = GPT(65, block_size=args.block, n_layer=2, n_head=4, n_embd=args.embd, dropout=0.0)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        m = DDP(m.to("tpu"))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("tpu", (size,))
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 65, (args.batch, args.block + 1), generator=g).to("tpu") for _ in range(4)]

    from common import optimizer_step, timed_steps

    def step(i):
        d = data[i % len(data)]
        return optimizer_step(lambda: m(d[:, :-1], d[:, 1:])[1], opt)

    secs = timed_steps(step, args.warmup, args.steps, before=lambda: (dist.barrier(), torch_tpu.reset_metrics()))
    dist.barrier()
    staged = torch_tpu.metrics()["dist_staged_bytes"]
    if rank == 0:
        toks = args.steps * args.batch * args.block * size
        print("RESULT " + json.dumps({"mode": args.mode, "ranks": size, "tokens_per_s": toks / secs,
                                      "step_ms": secs / args.steps * 1e3,
                                      "staged_mb_per_step": staged / args.steps / 1e6}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    results = []
    for mode in ("ddp", "fsdp2"):
        for ranks in (1, 2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.abspath(__file__), "--mode", mode, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--batch", str(args.batch), "--block", str(args.block), "--embd", str(args.embd)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{mode} x{ranks} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            r = json.loads(line[7:])
            results.append(r)
            print(f"{mode:6s} {ranks} rank(s): {r['tokens_per_s']:9.0f} tokens/s, {r['step_ms']:7.1f} ms/step, "
                  f"{r['staged_mb_per_step']:.2f} MB staged/step", flush=True)
    if args.markdown:
        from common import provenance, provenance_lines

        lines = ["# DDP and FSDP2 throughput on tpu (tpu_dist, staged)", "",
                 f"Written by `benchmarks/dist_train.py`: the project's GPT (2 layers, {args.embd} wide), batch "
                 f"{args.batch} x {args.block} tokens per rank, AdamW, {args.steps} timed steps after {args.warmup}."
                 " Both ranks share this machine's 2 cores, so 2 ranks cannot be faster than 1 here; the ratio"
                 " shows what the collectives and the sharing cost.", "", *provenance_lines(provenance()), "",
                 "| mode | ranks | tokens/s (all ranks) | ms/step | MB staged per step | vs 1 rank |", "|---|---:|---:|---:|---:|---:|"]
        base = {}
        for r in results:
            base.setdefault(r["mode"], r["tokens_per_s"])
            lines.append(f"| {r['mode']} | {r['ranks']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | "
                         f"{r['staged_mb_per_step']:.2f} | {r['tokens_per_s'] / base[r['mode']]:.2f}x |")
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
