#!/usr/bin/env python3
"""Host microseconds per op, without the device's own time: what torch_tpu's
dispatcher and each mode add on the host, the figure that carries from the CPU
plugin to an accelerator.

The ops of op_overhead.py (64x64 float32), in strict and fused eager. The
runtime loads benchmarks/pjrt_timer.c, a PJRT plugin that wraps the real one
and times every call where the device or the plugin works (launches, waits,
host<->device copies, compiles): host time = wall time - time inside PJRT. Any
build loads it unchanged, so two builds are measured alike:

    python benchmarks/host_cost.py [--rounds 3] [--json out.json]
    python benchmarks/host_cost.py --before /work/before-0cc1e88   # A/B, in turns
    python benchmarks/host_cost.py --side 0cc1e88=/work/before-0cc1e88 --side now=.   # any sides, in turns

Each side runs in fresh processes (`--rounds` per side, alternating order),
each process timing every case `--inner` times. Where the build has the
dispatcher's counters (tpu::_dispatch_stats), the host time is split into the
dispatcher (entry to the mode), the mode (its launches excluded), the
synchronize at the end (fused eager runs its graph there) and the rest: Python,
PyTorch's own dispatch above the device, and torch_tpu's kernels that do not go
through the dispatcher (views, copies: `contiguous` is a copy, so its row has no
split). The split comes from separate passes with the dispatcher's timers on
(three clock reads per op); the totals from passes with them off.

Times on a shared 2-core machine move by 50% from minute to minute; a change of
a few percent shows only in instructions. `--callgrind` runs each side once
under valgrind's callgrind and counts the instructions the calling thread
executes per op outside PJRT (deterministic: the same build gives the same
count to a fraction of a percent), with the dispatcher's and the mode's shares
where their functions are found:

    python benchmarks/host_cost.py --callgrind --side 0cc1e88=/work/before-0cc1e88 --side now=.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STATS = ["launch_ns", "launches", "await_ns", "awaits", "to_host_ns", "to_hosts", "from_host_ns", "from_hosts",
         "compile_ns", "compiles", "compile_bytes", "load_ns", "loads", "pjrt_cpu_ns"]
PJRT_NS = ["launch_ns", "await_ns", "to_host_ns", "from_host_ns", "compile_ns", "load_ns"]


def real_plugin() -> str:
    """The CPU plugin the runtime would load (xla-cpu-pjrt's)."""
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        hits = glob.glob(os.path.join(sp, "xla_plugins", "xla_cpu_pjrt", "xla_cpu_pjrt.so"))
        if hits:
            return hits[0]
    raise SystemExit("host_cost.py: xla-cpu-pjrt is not installed")


def build_timer(out_dir: str) -> str:
    """Compiles pjrt_timer.c (a few seconds, once per run) against the plugin's own header."""
    real = real_plugin()
    lib = os.path.join(out_dir, "libpjrt_timer_cpu.so")  # "cpu" in the name: see pjrt_timer.c
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-I", os.path.join(os.path.dirname(real), "include"),
                    os.path.join(HERE, "pjrt_timer.c"), "-o", lib, "-ldl"], check=True)
    return lib


# ---------------------------------------------------------------- the worker (one process, one build)

def timer_plugin():
    """The PJRT timer plugin this process runs (TORCH_TPU_PLUGIN is benchmarks/pjrt_timer.c's build)."""
    return ctypes.CDLL(os.environ["TORCH_TPU_PLUGIN"])


def pjrt_stats_reader(timer=None):
    """A function returning the timer plugin's counters as {STATS name: value}."""
    timer = timer or timer_plugin()
    buf = (ctypes.c_int64 * len(STATS))()

    def read() -> dict:
        timer.pjrt_timer_stats(buf)
        return dict(zip(STATS, buf))

    return read


def dispatch_stat_names():
    """The dispatcher's counter names, or None for a build without them (0cc1e88's)."""
    import torch

    try:
        return list(torch.ops.tpu._dispatch_stat_names())
    except (AttributeError, RuntimeError):
        return None


def report(out: dict, lines, args) -> dict:
    """Adds the provenance, prints lines(out) (a table's lines) and writes --json."""
    sys.path.insert(0, HERE)
    from common import provenance  # imports torch_tpu from this tree: the runner's own

    out["provenance"] = provenance()
    for line in lines(out):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def worker(args) -> dict:
    import torch

    import torch_tpu

    tree = os.path.realpath(args.tree)
    assert os.path.realpath(torch_tpu.__file__).startswith(tree + os.sep), (torch_tpu.__file__, tree)
    import op_overhead  # after torch_tpu: its helpers import torch_tpu again, from this tree

    timer = timer_plugin()
    pjrt = pjrt_stats_reader(timer)
    names = dispatch_stat_names()

    def dstats():
        return dict(zip(names, torch.ops.tpu._dispatch_stats())) if names else {}

    n, iters = args.size, args.iters
    cases = {k: v for k, v in op_overhead.cases(n).items() if not args.cases or any(c in k for c in args.cases)}
    modes = args.modes.split(",")
    out = {name: {m: [] for m in modes} for name in cases}
    operands = {}
    for name in cases:
        for m in modes:
            with torch_tpu.mode(m):
                operands[name, m] = (torch.randn(n, n, device="tpu"), torch.randn(n, n, device="tpu"))

    def loop(fn, ops):
        for _ in range(iters):
            fn(*ops)

    if args.callgrind_run:  # instructions only, one dump per case and mode (run by --callgrind)
        for name in cases:
            for m in modes:
                with torch_tpu.mode(m):
                    for _ in range(2):
                        loop(cases[name], operands[name, m])
                        torch.tpu.synchronize()
                    timer.pjrt_timer_callgrind_start()
                    loop(cases[name], operands[name, m])
                    torch.tpu.synchronize()
                    timer.pjrt_timer_callgrind_dump(f"{name}|{m}".encode())
        return {"torch_tpu": torch_tpu.__file__}

    def measure(name, m, split):
        fn, ops = cases[name], operands[name, m]
        if names:
            torch.ops.tpu._dispatch_timing(split)
        timer.pjrt_timer_reset()
        d0 = dstats()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        loop(fn, ops)
        t1 = time.perf_counter_ns()
        p1, d1 = pjrt(), dstats()
        torch.tpu.synchronize()
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        p2 = pjrt()
        if names:
            torch.ops.tpu._dispatch_timing(False)
        in_ops, total = sum(p1[k] for k in PJRT_NS), sum(p2[k] for k in PJRT_NS)
        r = {"host_us": ((t2 - t0) - total) / iters / 1e3, "pjrt_us": total / iters / 1e3,
             "host_cpu_us": ((c2 - c0) - p2["pjrt_cpu_ns"]) / iters / 1e3,
             "launches": p2["launches"] / iters, "uploads": p2["from_hosts"] / iters, "compiles": p2["compiles"],
             "sync_us": ((t2 - t1) - (total - in_ops)) / iters / 1e3}
        if names:
            d = {k: d1[k] - d0[k] for k in names}
            r["dispatched"] = d["ops"] / iters
            if split and d["ops"]:  # else the op's PJRT calls were made outside the dispatcher
                mode_ns = d["strict_ns"] + d["fused_ns"] + d["fallback_ns"]
                r["dispatch_us"] = d["dispatch_ns"] / iters / 1e3
                r["mode_us"] = (mode_ns - in_ops) / iters / 1e3
        return r

    for name in cases:  # warm-up: every program and graph compiled (or loaded) before any timing
        for m in modes:
            with torch_tpu.mode(m):
                for _ in range(2):
                    loop(cases[name], operands[name, m])
                    torch.tpu.synchronize()
    for _ in range(args.inner):
        for name in cases:
            for m in modes:
                with torch_tpu.mode(m):
                    r = measure(name, m, split=False)
                    if names and not args.no_split:
                        s = measure(name, m, split=True)
                        r.update({k: s[k] for k in ("dispatch_us", "mode_us") if k in s})
                        r["split_host_us"] = s["host_us"]
                out[name][m].append(r)
    return {"torch_tpu": torch_tpu.__file__, "has_split": bool(names), "cases": out}


# ---------------------------------------------------------------- the runner

def run_side(tree: str, timer: str, cache: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TORCH_TPU_PLUGIN=timer, PJRT_TIMER_REAL=real_plugin(),
               TORCH_TPU_CACHE_DIR=cache)
    with tempfile.NamedTemporaryFile(suffix=".json") as f, tempfile.TemporaryDirectory() as cg:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--inner", str(args.inner),
               "--iters", str(args.iters), "--size", str(args.size), "--modes", args.modes, "--json", f.name]
        cmd += ["--no-split"] if args.no_split else []
        cmd += [a for c in args.cases for a in ("--case", c)]
        if args.callgrind:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                   f"--callgrind-out-file={cg}/cg.out", *cmd, "--callgrind-run"]
        subprocess.run(cmd, check=True, env=env, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(f.name) as fh:
            out = json.load(fh)
        if args.callgrind:
            out["instructions"] = callgrind_counts(cg, args.iters)
            if args.keep:
                import shutil

                dest = os.path.join(args.keep, os.path.basename(os.path.abspath(tree)))
                shutil.copytree(cg, dest, dirs_exist_ok=True)
        return out


# Functions whose inclusive instructions are the dispatcher (entry to the mode) and
# the modes, in this build's names (0cc1e88's dispatch.cpp had other names: there the
# split is not given).
DISPATCHER = ("tpu::aten::(anonymous namespace)::boxedKernel(",)
MODES = ("tpu::eager::runStrict", "tpu::eager::runFused", "tpu::aten::cpuFallback(")


def parse_callgrind(path: str) -> dict:
    """One callgrind dump: its trigger label, the total instructions, those inside PJRT
    (the calls the timer plugin's wrappers make), and each function's inclusive
    instructions (its own plus its calls')."""
    names, fn, after_calls, label = {}, None, False, None
    total, pjrt, incl = 0, 0, {}

    def name(spec):
        m = re.match(r"\((\d+)\)(?:\s+(.*))?", spec)
        if not m:
            return spec
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), spec)

    with open(path) as f:
        for line in f:
            if after_calls:
                after_calls = False
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                incl[fn] = incl.get(fn, 0) + cost
                if fn.startswith("timed_PJRT"):
                    pjrt += cost
                continue
            if line.startswith("fn="):
                fn = name(line[3:].strip())
            elif line.startswith("cfn="):
                name(line[4:].strip())
            elif line.startswith("calls="):
                after_calls = True
            elif line.startswith("desc: Trigger: Client Request: "):
                label = line.split("Client Request: ", 1)[1].strip()
            elif line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) > 1:
                    incl[fn] = incl.get(fn, 0) + int(parts[1])
    return {"label": label, "total": total, "pjrt": pjrt, "incl": incl}


def callgrind_counts(folder: str, iters: int) -> dict:
    """Per case|mode: instructions per op on the calling thread (thread 1), outside PJRT;
    with the dispatcher's and the modes' shares where this build has those functions."""
    out = {}
    paths = glob.glob(os.path.join(folder, "cg.out.*-01"))  # thread 1's part of each dump, in dump order
    for path in sorted(paths, key=lambda p: int(re.search(r"cg\.out\.(\d+)-01$", p).group(1))):
        d = parse_callgrind(path)
        if not d["label"]:
            continue

        def inclusive(prefixes):
            return sum(v for k, v in d["incl"].items() if k and k.startswith(prefixes))

        r = {"host_instr": (d["total"] - d["pjrt"]) / iters, "pjrt_instr": d["pjrt"] / iters}
        disp, modes = inclusive(DISPATCHER), inclusive(MODES)
        if disp:
            r["dispatcher_instr"] = (disp - modes) / iters
            r["mode_instr"] = (modes - d["pjrt"]) / iters  # PJRT is called from the modes (launches)
        out[d["label"]] = r
    return out


def med(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def summarize(procs: list) -> dict:
    """Per case and mode: medians over every timing of every process, and the
    noise of each figure: the spread (max - min over median) of the per-process medians."""
    out = {}
    for name, by_mode in procs[0]["cases"].items():
        out[name] = {}
        for m in by_mode:
            rows = [r for p in procs for r in p["cases"][name][m]]
            s = {k: med(rows, k) for k in rows[0]}
            for key in ("host_us", "host_cpu_us"):
                per_proc = [med(p["cases"][name][m], key) for p in procs]
                mid = statistics.median(per_proc)
                s[key + "_procs"] = per_proc
                s[key + "_noise"] = (max(per_proc) - min(per_proc)) / mid if mid else 0.0
            s["noise"] = s["host_cpu_us_noise"]
            s["timings"] = len(rows)
            out[name][m] = s
    return out


def paired_ratios(summary: dict) -> dict:
    """Each later side against the first, round by round: a round's sides ran minutes
    apart at most, so the ratio of their host CPU medians in one round is less exposed
    to the shared machine's drift than the ratio of overall medians. Per case and mode:
    the median of the per-round ratios and their lowest and highest; and, per mode, the
    geometric mean over the cases of the median ratios."""
    names = list(summary)
    out = {}
    for n in names[1:]:
        out[n] = {}
        for case, by_mode in summary[names[0]].items():
            for m, r0 in by_mode.items():
                per_round = [a / b for a, b in zip(summary[n][case][m]["host_cpu_us_procs"], r0["host_cpu_us_procs"])]
                out[n][f"{case}|{m}"] = {"ratio": statistics.median(per_round), "low": min(per_round),
                                         "high": max(per_round)}
        for m in {k.split("|")[1] for k in out[n]}:
            out[n]["geomean|" + m] = {"ratio": statistics.geometric_mean(
                [v["ratio"] for k, v in out[n].items() if k.endswith("|" + m) and not k.startswith("geomean")])}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="source tree of an earlier build: an A/B, in turns")
    ap.add_argument("--after", default=ROOT, help="source tree of the later build (default: this one)")
    ap.add_argument("--side", action="append", default=[], metavar="NAME=TREE",
                    help="builds to compare, in this order (instead of --before/--after)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side")
    ap.add_argument("--inner", type=int, default=3, help="timings of each case per process")
    ap.add_argument("--iters", type=int, default=200, help="calls per timing")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--modes", default="strict,fused")
    ap.add_argument("--no-split", action="store_true", help="skip the passes with the dispatcher's timers on")
    ap.add_argument("--callgrind", action="store_true", help="count instructions under valgrind instead of timing")
    ap.add_argument("--callgrind-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", dest="cases", action="append", default=[], help="only cases whose name contains this")
    ap.add_argument("--keep", default=None, help="--callgrind: copy the dumps into this folder")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = worker(args)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return out
    if args.side:
        sides = dict(s.split("=", 1) for s in args.side)
    else:
        sides = {"before": args.before, "after": args.after} if args.before else {"now": args.after}
    procs = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        timer = build_timer(tmp)
        for r in range(args.rounds):
            order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]  # each side first in turn
            for s in order:
                cache = os.path.join(tmp, "cache-" + s)  # one per side, shared by its rounds
                procs[s].append(run_side(sides[s], timer, cache, args))
                print(f"round {r + 1} {s} done", flush=True)
    if args.callgrind:
        return finish_callgrind(sides, procs, args)
    summary = {s: summarize(p) for s, p in procs.items()}
    paired = paired_ratios(summary) if len(summary) > 1 else {}
    out = {"sides": {s: os.path.abspath(t) for s, t in sides.items()}, "rounds": args.rounds, "inner": args.inner,
           "iters": args.iters, "size": args.size, "modes": args.modes.split(","), "summary": summary,
           "paired": paired}
    return report(out, table, args)


def finish_callgrind(sides: dict, procs: dict, args) -> dict:
    counts = {}
    for side, runs in procs.items():
        counts[side] = {}
        for label in runs[0]["instructions"]:
            rows = [r["instructions"][label] for r in runs]
            counts[side][label] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            host = [r["host_instr"] for r in rows]
            counts[side][label]["spread"] = (max(host) - min(host)) / counts[side][label]["host_instr"]
    out = {"sides": {s: os.path.abspath(t) for s, t in sides.items()}, "rounds": args.rounds, "iters": args.iters,
           "size": args.size, "modes": args.modes.split(","), "instructions": counts}
    return report(out, callgrind_table, args)


def callgrind_table(out: dict) -> list:
    """Markdown: host instructions per op (thousands) per side, the ratios to the first
    side, and the last side's split into the dispatcher and the mode."""
    counts, names = out["instructions"], list(out["instructions"])
    last = names[-1]

    def row(cells):
        return "| " + " | ".join(cells) + " |"

    head = ["op", "mode", *(f"{n} (k instr/op)" for n in names), *(f"{n} / {names[0]}" for n in names[1:]),
            f"{last}: dispatcher", f"{last}: mode", "PJRT (k instr/op)"]
    lines = [row(head), row(["---", "---"] + ["---:"] * (len(head) - 2))]
    labels = list(counts[names[0]])
    for label in labels:
        case, mode = label.split("|")
        rows = [counts[n][label] for n in names]
        r = rows[-1]
        split = [fmt(r[k] / 1e3) if k in r else "" for k in ("dispatcher_instr", "mode_instr")]
        lines.append(row([case, mode, *(f"{x['host_instr'] / 1e3:.1f}" for x in rows),
                          *(f"{x['host_instr'] / rows[0]['host_instr']:.3f}" for x in rows[1:]), *split,
                          f"{r['pjrt_instr'] / 1e3:.1f}"]))
    for mode in out["modes"]:
        sel = [lb for lb in labels if lb.endswith("|" + mode)]
        g = [statistics.geometric_mean([counts[n][lb]["host_instr"] for lb in sel]) for n in names]
        lines.append(row(["geometric mean", mode, *(f"{v / 1e3:.1f}" for v in g), *(f"{v / g[0]:.3f}" for v in g[1:]),
                          "", "", ""]))
    return lines


def fmt(v, spec=".1f"):
    return "" if v is None else format(v, spec)


def table(out: dict) -> list:
    """Markdown: the split per op and mode (one build), or before/after (an A/B)."""
    modes, summary = out["modes"], out["summary"]
    if len(summary) == 1:
        s = next(iter(summary.values()))
        lines = ["| op | mode | host CPU us/op | host wall us/op | dispatcher | mode | sync | the rest | "
                 "ops dispatched | launches/op | PJRT wall us/op | noise (CPU, wall) |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, by_mode in s.items():
            for m in modes:
                r = by_mode[m]
                rest = None
                if r.get("dispatch_us") is not None:
                    rest = r["host_us"] - r["dispatch_us"] - r["mode_us"] - r["sync_us"]
                lines.append(f"| {name} | {m} | {fmt(r['host_cpu_us'])} | {fmt(r['host_us'])} | "
                             f"{fmt(r.get('dispatch_us'), '.2f')} | {fmt(r.get('mode_us'))} | {fmt(r['sync_us'])} | "
                             f"{fmt(rest)} | {fmt(r.get('dispatched'), '.0f')} | {fmt(r['launches'], '.2f')} | "
                             f"{fmt(r['pjrt_us'])} | {r['host_cpu_us_noise']:.2f}, {r['host_us_noise']:.2f} |")
        return lines
    names = list(summary)
    first = summary[names[0]]
    paired = out["paired"]
    head = " | ".join(f"{n} host CPU us/op" for n in names)
    ratios = " | ".join(f"{n} / {names[0]} (rounds' low-high)" for n in names[1:])
    lines = [f"| op | mode | {head} | {ratios} | noise ({', '.join(names)}) | launches/op |",
             "| --- | --- | " + " | ".join("---:" for _ in range(2 * len(names) - 1)) + " | ---: | ---: |"]
    for case in first:
        for m in modes:
            rows = [summary[n][case][m] for n in names]
            pr = [paired[n][f"{case}|{m}"] for n in names[1:]]
            lines.append(f"| {case} | {m} | " + " | ".join(f"{r['host_cpu_us']:.1f}" for r in rows) + " | " +
                         " | ".join(f"{p['ratio']:.2f} ({p['low']:.2f}-{p['high']:.2f})" for p in pr) + " | " +
                         ", ".join(f"{r['host_cpu_us_noise']:.2f}" for r in rows) + " | " +
                         ", ".join(f"{r['launches']:.2f}" for r in rows) + " |")
    for m in modes:
        g = [statistics.geometric_mean([summary[n][c][m]["host_cpu_us"] for c in first]) for n in names]
        lines.append(f"| geometric mean | {m} | " + " | ".join(f"{v:.1f}" for v in g) + " | " +
                     " | ".join(f"{paired[n]['geomean|' + m]['ratio']:.2f}" for n in names[1:]) + " | | |")
    for m in modes:
        g = [statistics.geometric_mean([summary[n][c][m]["host_us"] for c in first]) for n in names]
        lines.append(f"| geometric mean, host wall us/op | {m} | " + " | ".join(f"{v:.1f}" for v in g) + " | " +
                     " | ".join(f"{v / g[0]:.2f}" for v in g[1:]) + " | | |")
    return lines


if __name__ == "__main__":
    main()
