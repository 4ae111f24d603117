#!/usr/bin/env python3
"""Compiled tensor-parallel, DDP and FSDP steps (the latter two as TorchTitan's SimpleFSDP
writes them) with their collectives inside their programs against the same steps with them
as calls between programs (TORCH_TPU_COLLECTIVES_IN_PROGRAM=0): 2 ranks as
threads on 2 devices of one process (4 for FSDP x TP), the rounds alternating the two, each run a process of
its own (tests/python/dist_workers/in_program.py).

    python benchmarks/collectives_in_program.py [--rounds 2] [--markdown docs/collectives_in_program.md]

Per rank per step: programs launched with collectives inside, collectives inside them,
collectives made as calls between programs (each a host round trip), and the step time
(median over steps 2-5 of both ranks; step 1 compiles).
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


def run(mode: str, inside: bool) -> dict:
    world = WORLDS.get(mode, 2)
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES=str(world), TORCH_TPU_PLUGIN="cpu", TORCH_TPU_FALLBACK="error",
               TORCH_TPU_COLLECTIVES_IN_PROGRAM="1" if inside else "0")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, WORKER, mode], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-3000:])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("result "))
    res = json.loads(line[len("result "):])
    steps = [s for rank in res["steps"] for s in rank[1:]]
    n = len(res["steps"][0])
    return {"seconds": statistics.median(s["seconds"] for s in steps),
            "replicated_programs": res["replicated_programs"] / (world * n),
            "collectives_in_programs": res["collectives_in_programs"] / (world * n),
            "calls": statistics.median(s["dist_xla_collectives"] for s in steps) / world,
            "loss": res["ranks"][0][-1], "reference": res["reference"][-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = {}
    for _ in range(args.rounds):
        for mode in ("tp", "sp", "replicate", "fully_shard", "simple_fsdp_tp", "titan_fsdp_tp"):
            for inside in (True, False):
                rows.setdefault((mode, inside), []).append(run(mode, inside))
    p = provenance()
    lines = ["# Collectives inside compiled programs", "",
             "Written by `benchmarks/collectives_in_program.py`: a compiled step over 2 ranks as threads "
             "(2 devices of one process; 4 for FSDP x TP), its collectives inside its programs against the same step with "
             "them as calls between programs, rounds alternating, each run a process of its own. Per rank "
             "per step; time: median of steps 2-5 of both ranks, one value per round.", "",
             f"- date: {p['date']}", f"- machine: {p['machine']}", f"- commit: {p['commit']}",
             f"- torch {p['torch']}, PJRT plugin {p['plugin']}", "",
             "| step | collectives | programs with collectives | collectives inside | calls between programs "
             "| step ms per round | last loss (CPU reference) |", "|---|---|---:|---:|---:|---|---|"]
    names = {"tp": "TP (colwise/rowwise MLPs)", "sp": "TP + sequence parallel, clipping, foreach AdamW",
             "replicate": "DDP (SimpleFSDP replicate), clipping, foreach AdamW",
             "fully_shard": "FSDP (SimpleFSDP fully_shard), clipping, foreach AdamW",
             "simple_fsdp_tp": "FSDP 2 x TP 2 (SimpleFSDP over dp, TP + sequence parallel over tp; 4 ranks), "
                               "clipping, foreach AdamW",
             "titan_fsdp_tp": "TorchTitan llama3 debug model: its TP plan (sequence + loss parallel) over tp, "
                              "SimpleFSDP over fsdp; 4 ranks, clipping, foreach AdamW"}
    for (mode, inside), runs in rows.items():
        r0 = runs[0]
        times = " / ".join(f"{r['seconds'] * 1e3:.1f}" for r in runs)
        lines.append(f"| {names[mode]} | {'inside' if inside else 'calls (split)'} | {r0['replicated_programs']:.0f} "
                     f"| {r0['collectives_in_programs']:.0f} | {r0['calls']:.0f} "
                     f"| {times} "
                     f"| {r0['loss']:.6f} ({r0['reference']:.6f}) |")
    lines += ["", "On this machine both ranks share 2 cores with Python, so time says little about an "
              "accelerator, where a call between programs is a host round trip and an idle interconnect; "
              "the counts carry over."]
    write_markdown(args.markdown, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
