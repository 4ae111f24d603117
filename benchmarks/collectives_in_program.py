#!/usr/bin/env python3
"""Compiled tensor-parallel, DDP and FSDP steps (the latter two as TorchTitan's SimpleFSDP
writes them, and TorchTitan's llama3 debug model) three ways: their collectives as calls
between programs (TORCH_TPU_COLLECTIVES_IN_PROGRAM=0), inside the compiled forward's and
backward's programs, and in fused eager (TORCH_TPU_DEFER_AND_FUSE=1), where those programs
are called inside one program per step with the eager clipping and optimizer. 2 ranks as
threads on 2 devices of one process (4 for FSDP x TP), the rounds alternating the three, each
run a process of its own (tests/python/dist_workers/in_program.py).

    python benchmarks/collectives_in_program.py [--rounds 2] [--markdown docs/collectives_in_program.md]

Per rank per step, medians over steps 3-5 (step 1 records and compiles, step 2 compiles fused
eager's step program): programs launched, those with collectives inside, collectives inside
them, collectives made as calls between programs (each a host round trip), and the step time
(both ranks' steps 3-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import provenance, write_markdown  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "python", "dist_workers", "in_program.py")
WORLDS = {"simple_fsdp_tp": 4, "titan_fsdp_tp": 4}  # ranks (threads, one device each); the others 2


VARIANTS = {"split": {"TORCH_TPU_COLLECTIVES_IN_PROGRAM": "0"},
            "inside": {"TORCH_TPU_COLLECTIVES_IN_PROGRAM": "1"},
            "fused": {"TORCH_TPU_COLLECTIVES_IN_PROGRAM": "1", "TORCH_TPU_DEFER_AND_FUSE": "1"}}


def run(mode: str, variant: str) -> dict:
    world = WORLDS.get(mode, 2)
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES=str(world), TORCH_TPU_PLUGIN="cpu", TORCH_TPU_FALLBACK="error",
               **VARIANTS[variant])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, WORKER, mode], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-3000:])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("result "))
    res = json.loads(line[len("result "):])
    later = res["steps"][0][2:]  # process-wide counts over rank 0's steps 3-5

    def per_rank(key):
        return statistics.median(s[key] for s in later) / world

    return {"seconds": statistics.median(s["seconds"] for rank in res["steps"] for s in rank[2:]),
            "programs": per_rank("executions"), "replicated_programs": per_rank("replicated_programs"),
            "collectives_in_programs": per_rank("collectives_in_programs"),
            "calls": per_rank("dist_xla_collectives"),
            "loss": res["ranks"][0][-1], "reference": res["reference"][-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = {}
    for _ in range(args.rounds):
        for mode in ("tp", "sp", "replicate", "fully_shard", "simple_fsdp_tp", "titan_fsdp_tp"):
            for variant in VARIANTS:
                rows.setdefault((mode, variant), []).append(run(mode, variant))
    p = provenance()
    lines = ["# Collectives inside compiled programs", "",
             "Written by `benchmarks/collectives_in_program.py`: a compiled step over 2 ranks as threads "
             "(2 devices of one process; 4 for FSDP x TP) three ways: its collectives as calls between programs "
             "(split), inside the compiled forward's and backward's programs (inside), and fused eager "
             "(`TORCH_TPU_DEFER_AND_FUSE=1`: those programs called inside one program per step with the eager "
             "clipping and optimizer). Rounds alternate the three, each run a process of its own. Per rank per "
             "step, medians over steps 3-5; time: median of both ranks' steps 3-5, one value per round.", "",
             f"- date: {p['date']}", f"- machine: {p['machine']}", f"- commit: {p['commit']}",
             f"- torch {p['torch']}, PJRT plugin {p['plugin']}", "",
             "| step | collectives | programs | with collectives | collectives inside | calls between programs "
             "| step ms per round | last loss (CPU reference) |", "|---|---|---:|---:|---:|---:|---|---|"]
    names = {"tp": "TP (colwise/rowwise MLPs)", "sp": "TP + sequence parallel, clipping, foreach AdamW",
             "replicate": "DDP (SimpleFSDP replicate), clipping, foreach AdamW",
             "fully_shard": "FSDP (SimpleFSDP fully_shard), clipping, foreach AdamW",
             "simple_fsdp_tp": "FSDP 2 x TP 2 (SimpleFSDP over dp, TP + sequence parallel over tp; 4 ranks), "
                               "clipping, foreach AdamW",
             "titan_fsdp_tp": "TorchTitan llama3 debug model: its TP plan (sequence + loss parallel) over tp, "
                              "SimpleFSDP over fsdp; 4 ranks, clipping, foreach AdamW"}
    for (mode, variant), runs in rows.items():
        r0 = runs[0]
        times = " / ".join(f"{r['seconds'] * 1e3:.1f}" for r in runs)
        lines.append(f"| {names[mode]} | {variant} | {r0['programs']:g} | {r0['replicated_programs']:g} "
                     f"| {r0['collectives_in_programs']:g} | {r0['calls']:g} "
                     f"| {times} "
                     f"| {r0['loss']:.6f} ({r0['reference']:.6f}) |")
    lines += ["", "On this machine both ranks share 2 cores with Python, so time says little about an "
              "accelerator, where a call between programs is a host round trip and an idle interconnect; "
              "the counts carry over."]
    write_markdown(args.markdown, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
