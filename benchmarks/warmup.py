#!/usr/bin/env python3
"""Cold warm-up: the GPT's first training steps in a fresh process with an empty
disk cache (TORCH_TPU_CACHE_DIR), in strict and fused eager, and where their
time goes: compiles (count, program size, seconds), launches, the dispatcher's
ops, and the host's own time.

    python benchmarks/warmup.py [--rounds 2] [--steps 5] [--json out.json]
    python benchmarks/warmup.py --side 0cc1e88=/work/before-0cc1e88 --side now=.   # builds in turns
    python benchmarks/warmup.py --variants default,fused-adamw,step-one-program   # what would cut it

The GPT, batch and step are fused_vs_strict.py's (2 layers, width 64, batch
16 x 64, AdamW, clipping, the loss read each step). The timer starts after
`import torch_tpu` and after PyTorch's lazy imports that any device pays (the
first optimizer imports torch._dynamo; their seconds are shown apart), and stops
when step N's loss is on the host. Each side and mode runs twice per round,
each time in a fresh process with a fresh cache: once plain (the seconds), once
through benchmarks/pjrt_timer.c (what PJRT did: compiles with their program
sizes and XLA seconds, launches; host seconds = wall - time inside PJRT).

Variants (this build only): `fused-adamw` builds AdamW with fused=True (one
_fused_adamw_ op per step instead of ~10 _foreach_ ops); `step-one-program`
records clip_grad_norm_ and opt.step() as one program in strict eager (the
whole-graph recording torch.compile uses, torch_tpu._C._begin_whole_graph):
a prototype of strict eager running an optimizer step's ops as one program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def worker(args) -> dict:
    t0 = time.perf_counter()
    import torch

    import torch_tpu

    tree = os.path.realpath(args.tree)
    assert os.path.realpath(torch_tpu.__file__).startswith(tree + os.sep), (torch_tpu.__file__, tree)
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401  (the first optimizer imports it, on any device)
    import torch._inductor  # noqa: F401

    t_lazy = time.perf_counter() - t0
    from host_cost import dispatch_stat_names, pjrt_stats_reader, timer_plugin

    timer = timer_plugin() if args.timed else None
    if timer:
        pjrt = pjrt_stats_reader(timer)
    names = dispatch_stat_names()

    def snapshot():
        m = torch_tpu.metrics()
        s = {"t": time.perf_counter(), "compiles": m["compiles"], "compile_s": m["compile_seconds"],
             "executions": m["executions"], "disk_hits": m.get("disk_hits", 0)}
        if timer:
            s.update(pjrt())
        if names:
            d = dict(zip(names, torch.ops.tpu._dispatch_stats()))
            s.update(ops=d["ops"], facts_built=d["facts_built"])
        return s

    torch_tpu.set_mode(args.mode)
    from torch_tpu.models import GPT

    start = snapshot()
    torch.manual_seed(0)
    model = GPT(96, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if args.variant == "fused-adamw" else {}))

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    gen = torch.Generator().manual_seed(0)
    marks = [snapshot()]
    for _ in range(args.steps):
        x = torch.randint(0, 96, (16, 64), generator=gen)
        _, loss = model(x.to("tpu"), x.to("tpu"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.variant == "step-one-program":
            entered = torch_tpu._C._begin_whole_graph()
            try:
                update()
            finally:
                torch_tpu._C._end_whole_graph(entered)
        else:
            update()
        loss.item()
        marks.append(snapshot())

    def diff(a, b):
        return {k: b[k] - a[k] for k in a}

    return {"import_s": t_import, "lazy_imports_s": t_lazy, "build": diff(start, marks[0]),
            "steps": [diff(a, b) for a, b in zip(marks, marks[1:])], "total": diff(start, marks[-1]),
            "compiles_by_op": torch_tpu.metrics().get("compiles_by_op", {}),
            "compile_reasons": list(torch_tpu.metrics().get("recompile_reasons", []))}


def run(tree: str, mode: str, variant: str, timer: str | None, args) -> dict:
    with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TORCH_TPU_CACHE_DIR=cache)
        log = os.path.join(cache, "compiles.log")
        if timer:
            from host_cost import real_plugin

            env.update(TORCH_TPU_PLUGIN=timer, PJRT_TIMER_REAL=real_plugin(), PJRT_TIMER_COMPILE_LOG=log)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--mode", mode,
               "--variant", variant, "--steps", str(args.steps), "--json", f.name] + (["--timed"] if timer else [])
        subprocess.run(cmd, check=True, env=env, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(f.name) as fh:
            out = json.load(fh)
        if timer:
            with open(log) as fh:
                out["compile_log"] = [tuple(int(v) for v in line.split()) for line in fh if line.strip()]
        return out


PJRT_NS = ["launch_ns", "await_ns", "to_host_ns", "from_host_ns", "compile_ns", "load_ns"]


def summarize(plain: list, timed: list) -> dict:
    secs = [p["total"]["t"] for p in plain]
    t = timed[len(timed) // 2]  # one of the timed runs (their counts are the same; times vary)
    tot = t["total"]
    pjrt_s = sum(tot[k] for k in PJRT_NS) / 1e9
    sizes = sorted(b for _, b in t["compile_log"])
    xla = sorted(ns / 1e9 for ns, _ in t["compile_log"])
    return {
        "seconds": statistics.median(secs), "runs": secs,
        "step_s": [statistics.median(p["steps"][i]["t"] for p in plain) for i in range(len(plain[0]["steps"]))],
        "build_s": statistics.median(p["build"]["t"] for p in plain),
        "lazy_imports_s": statistics.median(p["lazy_imports_s"] for p in plain),
        "compiles": tot["compiles"], "compile_s": statistics.median(p["total"]["compile_s"] for p in plain),
        "xla_compile_s": tot["compile_ns"] / 1e9, "program_bytes": tot["compile_bytes"],
        "median_program_bytes": statistics.median(sizes) if sizes else 0, "largest_program_bytes": max(sizes or [0]),
        "median_xla_compile_ms": 1e3 * statistics.median(xla) if xla else 0,
        "launches": tot["launches"], "launch_s": tot["launch_ns"] / 1e9, "pjrt_s": pjrt_s,
        "timed_wall_s": tot["t"], "host_s": tot["t"] - pjrt_s, "ops": tot.get("ops"),
        "compiles_per_step": [s["compiles"] for s in t["steps"]],
        "top_compiles": sorted(t["compiles_by_op"].items(), key=lambda kv: -kv[1])[:8],
        "compile_log": t["compile_log"],
        "by_op": by_op(t),
    }


def by_op(t: dict) -> list:
    """XLA seconds and program text per op (what compiled: "aten::mm", "fused graph", ...), largest
    first, from the timed run: the runtime notes each compile's op in order (its recompile reasons),
    the timer plugin each compile's seconds and size in the same order. Empty where the two do not
    pair up (a build without the reasons, or more than the 200 it keeps)."""
    reasons, log = t.get("compile_reasons", []), t["compile_log"]
    if not reasons or len(reasons) != len(log):
        return []
    out = {}
    for reason, (ns, size) in zip(reasons, log):
        op = reason.split(": ", 1)[0]
        r = out.setdefault(op, {"op": op, "compiles": 0, "xla_s": 0.0, "bytes": 0})
        r["compiles"] += 1
        r["xla_s"] += ns / 1e9
        r["bytes"] += size
    return sorted(out.values(), key=lambda r: -r["xla_s"])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", action="append", default=[], metavar="NAME=TREE",
                    help="builds, in turns (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="strict,fused")
    ap.add_argument("--variants", default="default", help="default, fused-adamw, step-one-program (comma-separated)")
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="strict", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = worker(args)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return out
    from host_cost import build_timer

    sides = dict(s.split("=", 1) for s in args.side) if args.side else {"now": ROOT}
    modes, variants = args.modes.split(","), args.variants.split(",")
    runs = {(s, m, v): {"plain": [], "timed": []} for s in sides for m in modes for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        timer = build_timer(tmp)
        for r in range(args.rounds):
            order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            for s in order:
                for m in modes:
                    for v in variants:
                        runs[s, m, v]["plain"].append(run(sides[s], m, v, None, args))
                        runs[s, m, v]["timed"].append(run(sides[s], m, v, timer, args))
                        print(f"round {r + 1} {s} {m} {v} done", flush=True)
    summary = {f"{s}, {m}" + ("" if v == "default" else f", {v}"): summarize(r["plain"], r["timed"])
               for (s, m, v), r in runs.items()}
    from host_cost import report

    out = {"sides": {s: os.path.abspath(t) for s, t in sides.items()}, "steps": args.steps, "rounds": args.rounds,
           "summary": summary}
    return report(out, table, args)


def table(out: dict) -> list:
    lines = [f"| build, mode | first {out['steps']} steps (s) | per step (s) | compiles | XLA compile (s) | "
             "program text (KB: total, median, largest) | launches | host, outside PJRT (s) | runs (s) |",
             "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for name, s in out["summary"].items():
        steps = ", ".join(f"{v:.2f}" for v in s["step_s"])
        text = (f"{s['program_bytes'] / 1e3:.0f}, {s['median_program_bytes'] / 1e3:.1f}, "
                f"{s['largest_program_bytes'] / 1e3:.0f}")
        lines.append(f"| {name} | {s['seconds']:.2f} | {steps} | {s['compiles']} | {s['xla_compile_s']:.2f} | {text} | "
                     f"{s['launches']} | {s['host_s']:.2f} | "
                     f"{', '.join(f'{v:.2f}' for v in s['runs'])} |")
    return lines


def breakdown(out: dict, top: int = 8) -> list:
    """Markdown lines: per build and mode, compiles per step and where the XLA seconds went by op."""
    lines = []
    for name, s in out["summary"].items():
        per_step = ", ".join(str(c) for c in s["compiles_per_step"])
        ops = s.get("by_op") or []
        if ops:
            parts = [f"{r['op']} {r['compiles']} ({r['xla_s']:.2f} s, {r['bytes'] / 1e3:.0f} KB)" for r in ops[:top]]
            more = sum(r["xla_s"] for r in ops[top:])
            what = "; ".join(parts) + (f"; the rest {more:.2f} s" if ops[top:] else "")
        else:
            what = ", ".join(f"{op} {n}" for op, n in s["top_compiles"]) + " (compiles by op; no seconds per op)"
        lines.append(f"- {name}: compiles per step {per_step}; {what}")
    return lines


if __name__ == "__main__":
    main()
