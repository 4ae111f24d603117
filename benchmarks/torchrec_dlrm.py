#!/usr/bin/env python3
"""TorchRec DLRM training throughput under DistributedModelParallel with the plan TorchRec's
planner makes for the device, on tpu (strict and fused eager) and on PyTorch's CPU device (FBGEMM's
CPU kernels, gloo), 1 and 2 ranks, side by side in one run.

    python benchmarks/torchrec_dlrm.py [--steps 10] [--markdown docs/torchrec.md]

Run as is, it starts torchrun for each configuration; under torchrun (RANK set) it is the worker
and prints one JSON line from rank 0. The markdown is written between the markers of the page.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BEGIN, END = "<!-- benchmark: begin -->", "<!-- benchmark: end -->"


def worker(args):
    import torch
    import torch.distributed as dist

    import torch_tpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dist.init_process_group("cpu:gloo,tpu:tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, size = dist.get_rank(), dist.get_world_size()
    tpu = args.device == "tpu"
    device = torch.device("tpu", int(os.environ.get("LOCAL_RANK", 0))) if tpu else torch.device("cpu")
    if tpu:
        torch_tpu.set_fallback("error")
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]
    keys = [t.feature_names[0] for t in tables]
    m = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
             dense_in_features=13, dense_arch_layer_sizes=[128, args.dim], over_arch_layer_sizes=[128, 1],
             dense_device=device)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01})
    pg = dist.new_group(backend="tpu_dist" if tpu else "gloo")
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=size, compute_device=args.device)).collective_plan(
        m, [sharder], pg)
    from torchrec.distributed.types import ShardingEnv

    m = DistributedModelParallel(m, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                 sharders=[sharder])
    opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(m.named_parameters())),
                                lambda ps: torch.optim.Adagrad(ps, lr=0.01))
    g = torch.Generator().manual_seed(rank)
    data = []
    for _ in range(args.batches):
        lengths = torch.randint(0, args.pool + 1, (len(keys) * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        data.append((torch.randn(args.batch, 13, generator=g).to(device),
                     KeyedJaggedTensor(keys=keys, values=values.to(device), lengths=lengths.to(device)),
                     torch.randint(0, 2, (args.batch,), generator=g).float().to(device)))

    from common import optimizer_step, timed_steps

    def step(i):
        x, kjt, y = data[i % len(data)]
        return optimizer_step(
            lambda: torch.nn.functional.binary_cross_entropy_with_logits(m(x, kjt).squeeze(-1), y), opt)

    compiles = []
    secs = timed_steps(step, args.warmup, args.steps, before=lambda: (
        dist.barrier(group=dist.new_group(backend="gloo")), compiles.append(torch_tpu.metrics()["compiles"])))
    if rank == 0:
        kernels = sorted({(o.sharding_type, o.compute_kernel) for t in plan.plan.values() for o in t.values()})
        print("RESULT " + json.dumps({"samples_per_s": args.steps * args.batch * size / secs,
                                      "step_ms": secs / args.steps * 1e3, "plan": kernels,
                                      "compiles": torch_tpu.metrics()["compiles"] - compiles[0]}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4, help="steps before timing (4: each batch once)")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, cycled (each a new id count)")
    ap.add_argument("--batch", type=int, default=256, help="per rank")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--pool", type=int, default=20, help="most ids per sample and feature")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    shape = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--tables",
             str(args.tables), "--rows", str(args.rows), "--dim", str(args.dim), "--pool", str(args.pool)]
    results = []
    for ranks in (1, 2):
        for label, device, fused in (("cpu", "cpu", False), ("tpu strict", "tpu", False), ("tpu fused", "tpu", True)):
            env = {**os.environ, "TORCH_TPU_CPU_DEVICES": "2"}
            env.pop("TORCH_TPU_DEFER_AND_FUSE", None)
            if fused:
                env["TORCH_TPU_DEFER_AND_FUSE"] = "1"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.abspath(__file__), "--device", device, *shape]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{label} x{ranks} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            r = {**json.loads(line[7:]), "label": label, "ranks": ranks}
            results.append(r)
            print(f"{label:10s} {ranks} rank(s): {r['samples_per_s']:8.0f} samples/s, {r['step_ms']:7.1f} ms/step, "
                  f"{r['compiles']} compiles, plan {r['plan']}", flush=True)
    if args.markdown:
        from common import provenance, provenance_lines

        lines = [BEGIN, "",
                 f"Written by `benchmarks/torchrec_dlrm.py`: DLRM, {args.tables} tables of {args.rows} x {args.dim}, "
                 f"up to {args.pool} ids per sample and feature, batch {args.batch} per rank, the planner's plan with "
                 f"FBGEMM's TBE and row-wise Adagrad fused into the backward, {args.steps} timed steps after "
                 f"{args.warmup} (the 4 batches cycle: the timed steps compile nothing new). All ranks share this "
                 "machine's 2 cores.", "", *provenance_lines(provenance()), "",
                 "| device | ranks | plan | samples/s | ms/step | compiles (timed) | vs CPU |",
                 "|---|---:|---|---:|---:|---:|---:|"]
        cpu = {r["ranks"]: r["samples_per_s"] for r in results if r["label"] == "cpu"}
        for r in results:
            plan = ", ".join(f"{s} / {k}" for s, k in r["plan"])
            lines.append(f"| {r['label']} | {r['ranks']} | {plan} | {r['samples_per_s']:.0f} | {r['step_ms']:.1f} | "
                         f"{r['compiles']} | {r['samples_per_s'] / cpu[r['ranks']]:.2f}x |")
        lines += ["", END]
        with open(args.markdown) as f:
            text = f.read()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        with open(args.markdown, "w") as f:
            f.write(head + "\n".join(lines) + tail)


if __name__ == "__main__":
    main()
