#!/usr/bin/env python3
"""Ray Train step time on tpu against PyTorch's CPU device: one small training job through
``TorchTrainer``, side by side in one run, at 1 and 2 workers.

    python benchmarks/ray_train.py [--steps 20] [--rounds 1] [--markdown docs/ray.md-table.md]

The job: the project's GPT (2 layers, 128 wide, 64-token sequences), DDP through
``ray.train.torch.prepare_model``, AdamW, a fixed global batch of 16 sequences cycled over 4
batches; each worker trains on its equal share, so 1 and 2 workers compute the same losses.
- tpu: ``ScalingConfig(use_tpu=True, topology="1x1", accelerator_type="TPU-V6E")`` with one TPU
  chip per worker on a local cluster Ray detects as a 2-chip TPU host (tests/python/ray_local.py):
  backend ``tpu_dist``, the device Ray's TPU device manager gives (tpu).
- cpu: ``TorchConfig(backend="gloo")``, CPU-resource workers, PyTorch's CPU device.
Each worker gets 1 CPU from Ray and OMP_NUM_THREADS=1. A step is timed on rank 0 from before
the forward to after ``loss.item()`` (every step synchronizes); the step time is the median of
the timed steps, after warm-up steps (their first one compiles on tpu). The trainer's wall time
(``fit()``, from worker start to the last report) is shown beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))

from common import provenance, provenance_lines, write_json, write_markdown  # noqa: E402
from ray_local import local_tpu_cluster, reports_by_step, run_config, tpu_scaling_config  # noqa: E402

GLOBAL_BATCH = 16
BLOCK = 64
VOCAB = 65
N_BATCHES = 4


def train_loop(config):
    """One Ray Train worker: the GPT under DDP on the worker's device, its share of each global
    batch; rank 0 reports the per-step seconds and the global losses."""
    import torch
    import torch.distributed as dist

    import ray.train
    import ray.train.torch
    from torch_tpu.models import GPT

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    assert device.type == config["device"], (device, config["device"])
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=128,
                                              dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    share = GLOBAL_BATCH // world
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, BLOCK + 1), generator=g)[rank * share:(rank + 1) * share]
            .to(device) for _ in range(N_BATCHES)]

    seconds, losses = [], []
    for i in range(config["warmup"] + config["steps"]):
        d = data[i % N_BATCHES]
        t0 = time.perf_counter()
        _, loss = model(d[:, :-1], d[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        seconds.append(time.perf_counter() - t0)
    # Ray keeps a report's metrics only with a checkpoint: rank 0 reports one (empty) folder.
    with tempfile.TemporaryDirectory() as d:
        metrics = {"step": 0, "seconds": seconds, "losses": losses}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


def run(device: str, workers: int, args, storage: str, name: str) -> dict:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    if device == "tpu":
        scaling = tpu_scaling_config(workers)
        backend = TorchConfig()  # Ray picks tpu_dist for TPU workers
    else:
        scaling = ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})
        backend = TorchConfig(backend="gloo")
    trainer = TorchTrainer(train_loop, train_loop_config={"device": device, "steps": args.steps,
                                                          "warmup": args.warmup},
                           scaling_config=scaling, torch_config=backend,
                           run_config=run_config(storage, name))
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    m = reports_by_step(result)[0]
    timed = m["seconds"][args.warmup:]
    return {"device": device, "workers": workers, "step_s": statistics.median(timed), "first_step_s": m["seconds"][0],
            "fit_s": wall, "loss_first": m["losses"][0], "loss_last": m["losses"][-1]}


def report(rows: list, args) -> list:
    by = {(r["device"], r["workers"]): r for r in rows}
    lines = [*provenance_lines(provenance()), "",
             f"{args.steps} timed steps after {args.warmup}, {args.rounds} round(s); the step time is the median "
             "over the timed steps (and over rounds, the median of the rounds' medians).", "",
             "| workers | device | step ms (median) | first step s | fit() s | loss, step 1 | loss, last step | "
             "tpu / cpu step time |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for workers in args.workers:
        for device in ("tpu", "cpu"):
            r = by[(device, workers)]
            ratio = f"{r['step_s'] / by[('cpu', workers)]['step_s']:.2f}x" if device == "tpu" else ""
            lines.append(f"| {workers} | {device} | {r['step_s'] * 1e3:.1f} | {r['first_step_s']:.2f} | "
                         f"{r['fit_s']:.1f} | {r['loss_first']:.6f} | {r['loss_last']:.6f} | {ratio} |")
    return lines


def merge_rounds(per_round: list) -> list:
    """One row per configuration: the median over rounds of each figure."""
    rows = []
    for rs in zip(*per_round):
        row = dict(rs[0])
        for k in ("step_s", "first_step_s", "fit_s"):
            row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    per_round = []
    with tempfile.TemporaryDirectory(prefix="ray_results") as storage, \
            local_tpu_cluster(chips=max(args.workers), num_cpus=max(args.workers)):
        for i in range(args.rounds):
            # tpu and cpu in turns, so a slow spell of a shared machine falls on both alike. Each
            # run has a name of its own: Ray Train v2 would restore a run of the same name.
            per_round.append([run(device, workers, args, storage, f"{device}_{workers}_round{i}")
                              for workers in args.workers for device in ("tpu", "cpu")])
    rows = merge_rounds(per_round)
    write_json(args.json, {"provenance": provenance(), "rows": rows, "rounds": per_round})
    write_markdown(args.markdown, report(rows, args), echo=True)


if __name__ == "__main__":
    main()
