#!/usr/bin/env python3
"""Runs the benchmarks side by side and writes docs/benchmarks.md.

    python benchmarks/run_all.py                  # all of them
    python benchmarks/run_all.py --only serving   # the serving section alone, the rest kept
    python benchmarks/run_all.py --only fused     # fused against strict eager alone, the rest kept
    python benchmarks/run_all.py --only host --before /tmp/before-0cc1e88     # host cost per op, and an A/B
    python benchmarks/run_all.py --only warmup --before /tmp/before-0cc1e88   # cold warm-up, and an A/B

--before TREE names a checkout of an earlier commit with its extension built in place
(`git worktree add /tmp/before-0cc1e88 0cc1e88`, then cmake -B build -G Ninja && cmake --build build
there), so that PYTHONPATH=TREE imports that tree's torch_tpu; the side is named by the folder.
Each --only run replaces its own section and keeps the rest of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import compiled
import fused_vs_strict
import gpt_train
import host_cost
import op_overhead
import warmup
from common import provenance, provenance_lines

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
SERVING = "## Serving with vLLM: tpu against vLLM's CPU backend"


def serving_section() -> list[str]:
    """benchmarks/serving.py in the serving environment (scripts/setup_vllm.sh);
    its table (also in docs/serving_benchmark.md) without its title."""
    python = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        return [SERVING, "", "Not run: `bash scripts/setup_vllm.sh` makes the environment it needs.", ""]
    out = os.path.join(ROOT, "docs", "serving_benchmark.md")
    subprocess.run([python, os.path.join(HERE, "serving.py"), "--out", out], check=True)
    with open(out) as f:
        body = f.read().split("\n", 1)[1].strip()
    return [SERVING, "", body, "", "How the plugin works and what limits it: [serving.md](serving.md).", ""]


def section_head(title: str, only: str, prov: dict | None) -> list[str]:
    """A section's title, and its own provenance when it is rerun alone (--only)."""
    lines = [title, ""]
    if prov:
        lines += [f"Rerun alone (`run_all.py --only {only}`):", "", *provenance_lines(prov), ""]
    return lines


FUSED = "## Fused eager against strict eager"


def fused_section(prov: dict | None = None) -> list[str]:
    """benchmarks/fused_vs_strict.py as a section; `prov`: this section's own
    provenance, when it is rerun alone (--only fused)."""
    fv = fused_vs_strict.main([])
    lines = section_head(FUSED, "fused", prov)
    lines += [
        "Same programs, same process: each case built and warmed up in both modes, then timed in turns,",
        f"{fv['rounds']} rounds (throughput of the median round; higher is better). fused / strict: the ratio of",
        "the medians, with the lowest and highest round.",
        "",
        "| case | strict | fused | unit | fused / strict | rounds |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in fv["rows"]:
        lines.append(f"| {r['case']} | {r['strict']:.1f} | {r['fused']:.1f} | {r['unit']} | {r['speedup']:.2f}x | "
                     f"{r['low']:.2f}-{r['high']:.2f}x |")
    lines += [
        "",
        "A fresh process's first 3 GPT training steps (fused eager), with the disk cache cold and warm, and the same",
        "steps in PyTorch's CPU eager. The first optimizer any process builds imports torch._dynamo (PyTorch wraps",
        "`Optimizer.add_param_group` in `torch._disable_dynamo`), on any device; the second row starts the timer",
        "after that import (and torch._inductor's), so what it shows is torch_tpu's own start-up.",
        "",
        "| timer starts | cold cache (s) | warm cache (s) | warm / cold | CPU eager (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for imports, row in fv["startup"].items():
        cold, warm = row["cold"], row["warm"]
        lines.append(f"| {imports} | {cold['seconds']:.2f} ({cold['compiles']} compiles) | {warm['seconds']:.2f} "
                     f"({warm['compiles']} compiles) | {warm['seconds'] / cold['seconds']:.0%} | "
                     f"{row['cpu eager']['seconds']:.2f} |")
    lines.append("")
    return lines


HOST = "## Host time per op: what the dispatcher and the modes add"


def side_args(before: list[str] | None) -> list[str]:
    """--side NAME=TREE for each earlier build (named by its folder), then this one."""
    out = []
    for tree in before or []:
        out += ["--side", f"{os.path.basename(os.path.abspath(tree))}={tree}"]
    return out + ["--side", f"now={ROOT}"]


def host_section(before: list[str] | None = None, prov: dict | None = None) -> list[str]:
    """benchmarks/host_cost.py: host time per op split by the dispatcher's timers, and the
    instructions per op under callgrind; with `before`, the same counted for those builds."""
    sides = side_args(before)
    t = host_cost.main(["--rounds", "3", "--inner", "3", *sides])
    last = list(t["summary"])[-1]
    now = {**t, "summary": {last: t["summary"][last]}}  # this build alone: its split
    cg = host_cost.main(["--callgrind", "--rounds", "1", *sides])
    lines = section_head(HOST, "host", prov)
    lines += [
        f"The ops of the per-op table ({t['size']}x{t['size']} float32), strict and fused eager. Host time is what the",
        "calling thread spends outside PJRT: the runtime loads benchmarks/pjrt_timer.c, a PJRT plugin that wraps the",
        "real one and times its launches, waits, copies and compiles, so the figure leaves the device's own work",
        "out and carries to an accelerator. `host CPU` is the thread's CPU time less its CPU time inside PJRT;",
        "`host wall` is wall time less time inside PJRT. The split (from passes with the dispatcher's timers on,",
        "`tpu::_dispatch_timing`): `dispatcher` is csrc/dispatch/dispatcher.cpp from entry to the mode, `mode` the",
        "mode's own work (launches excluded), `sync` the host part of the final `torch.tpu.synchronize()` (fused",
        "eager runs its graph there), `the rest` Python, PyTorch's dispatch above the device and torch_tpu's kernels",
        "that do not pass the dispatcher (views, copies: `contiguous` is a copy, so its row has no split).",
        f"Medians of {t['rounds']} processes x {t['inner']} timings of {t['iters']} calls; noise: the spread of the",
        "processes' medians over their median. On a shared 2-core machine it is large; the instruction counts",
        "below are not.",
        "",
        *host_cost.table(now),
        "",
    ]
    if len(t["summary"]) > 1:
        lines += [
            "The same timings side by side with the earlier builds (`--before`): each side in its own processes, in",
            "turns, the order rotating each round; a ratio is the median over rounds of the two sides' host CPU",
            "medians in the same round (less exposed to the machine's drift than a ratio of overall medians), with",
            "the rounds' lowest and highest.",
            "",
            *host_cost.table(t),
            "",
        ]
    lines += [
        "Instructions per op on the calling thread outside PJRT (`host_cost.py --callgrind`: valgrind's callgrind,",
        f"instrumentation on only around {cg['iters']} calls of each case; thousands). `dispatcher`: boxedKernel",
        "inclusive less the modes; `mode`: runStrict/runFused/the CPU fallback inclusive less PJRT. Counts repeat to",
        "within a few percent from run to run (allocator state).",
        "",
        *host_cost.callgrind_table(cg),
        "",
    ]
    return lines


WARMUP = "## Cold warm-up: the GPT's first steps"


def warmup_section(before: list[str] | None = None, prov: dict | None = None) -> list[str]:
    w = warmup.main(["--rounds", "3", *side_args(before)])
    lines = section_head(WARMUP, "warmup", prov)
    lines += [
        "`benchmarks/warmup.py`: a fresh process, an empty `TORCH_TPU_CACHE_DIR`, the GPT's first",
        f"{w['steps']} training steps (fused_vs_strict.py's GPT and step, the loss read each step), strict and fused",
        "eager. The timer starts",
        "after `import torch_tpu` and PyTorch's own lazy imports (torch._dynamo, which any device's first optimizer",
        "imports) and stops when the last loss is on the host. Seconds: median of "
        f"{w['rounds']} runs; the breakdown: one run through the PJRT timer plugin (compiles with their",
        "program text and XLA seconds, launches; host = wall - time inside PJRT).",
        "",
        *warmup.table(w),
        "",
        "Where the compiling goes (the timed run: each compile's op, as the runtime notes it, paired with the timer",
        "plugin's seconds and program text in order; strict eager compiles a program per op signature, fused eager",
        "one per graph):",
        "",
        *warmup.breakdown(w),
        "",
        "For reference, not rerun here: TorchTPU 0.2.0 took 2.98 s for these 5 cold steps, and torch_tpu 3.95 s, side",
        "by side on the same XLA:CPU in an earlier session, through a PJRT shim that is not in this repository.",
        "",
    ]
    return lines


# The full run's order of the sections --only can rerun: a section not in the file yet goes before
# the first of those after it that is.
ORDER = [FUSED, HOST, WARMUP, "## torch.compile(backend=\"tpu\") against eager and inductor", SERVING]


def replace_section(text: str, heading: str, section: list[str]) -> str:
    """text with the section under `heading` (up to the next "## ") replaced; a new one goes where the
    full run puts it (ORDER), else at the end."""
    start = text.find(heading + "\n")
    if start < 0:
        later = ORDER[ORDER.index(heading) + 1:] if heading in ORDER else []
        for h in later:
            at = text.find("\n" + h + "\n")
            if at >= 0:
                return text[:at + 1] + "\n".join(section) + "\n" + text[at + 1:]
        return text.rstrip("\n") + "\n\n" + "\n".join(section)
    end = text.find("\n## ", start + len(heading))
    return text[:start] + "\n".join(section) + ("" if end < 0 else text[end:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["serving", "fused", "host", "warmup"],
                    help="rerun one section and keep the rest of the file")
    ap.add_argument("--before", action="append", default=[],
                    help="host and warmup sections: an earlier build's tree to compare (repeatable)")
    args = ap.parse_args()
    if args.only:
        t0 = time.perf_counter()
        with open(DOC) as f:
            text = f.read()
        if args.only == "serving":
            text = replace_section(text, SERVING, serving_section())
        elif args.only == "host":
            text = replace_section(text, HOST, host_section(args.before, provenance()))
        elif args.only == "warmup":
            text = replace_section(text, WARMUP, warmup_section(args.before, provenance()))
        else:
            text = replace_section(text, FUSED, fused_section(provenance()))
        with open(DOC, "w") as f:
            f.write(text)
        print(f"wrote {DOC} ({args.only}: {time.perf_counter() - t0:.0f} s)")
        return
    prov = provenance()
    ops = op_overhead.main(["--iters", "200"])
    thr = op_overhead.main(["--throughput"])
    gpt = gpt_train.main([])
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/run_all.py`. Ratios are taken side by side in one run; absolute",
        "times on shared machines do not compare across runs.",
        "",
        *provenance_lines(prov),
        "",
        "## Per-op overhead, strict eager",
        "",
        f"Microseconds per op on {ops['size']}x{ops['size']} float32 tensors, device work included (the",
        "timer stops after `torch.tpu.synchronize()`), median of 5 repeats of 200 calls.",
        "",
        "| op | CPU eager (us) | tpu strict eager (us) | tpu / CPU |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in ops["rows"]:
        lines.append(f"| {r['op']} | {r['ref_us']:.1f} | {r['tpu_us']:.1f} | {r['ratio']:.1f}x |")
    lines += [
        "",
        f"## Op throughput at {thr['size']}x{thr['size']}, strict eager",
        "",
        "Larger operands (`op_overhead.py --throughput`): where a lowering compiles into slow XLA:CPU code it",
        f"shows here. Median of 5 repeats of {thr['iters']} calls, slowest relative to the CPU first.",
        "",
        "| op | CPU eager (us) | tpu strict eager (us) | tpu / CPU |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in sorted(thr["rows"], key=lambda r: -r["ratio"]):
        lines.append(f"| {r['op']} | {r['ref_us']:.1f} | {r['tpu_us']:.1f} | {r['ratio']:.1f}x |")
    c = gpt["config"]
    lines += [
        "",
        "## GPT training step",
        "",
        f"Character GPT ({c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}), batch {c['batch_size']} x "
        f"{c['block_size']} tokens, AdamW, gradient clipping; {c['steps']} timed steps after {c['warmup']} warm-up steps.",
        "",
        "| device | tokens/s | ms/step | first step (s) | final loss |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in gpt["results"]:
        lines.append(f"| {r['device']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {r['first_step_s']:.2f} | "
                     f"{r['final_loss']:.4f} |")
    lines += ["", f"tpu / CPU throughput: {gpt['ratio']:.2f}x", ""]
    lines += fused_section()
    lines += host_section(args.before)
    lines += warmup_section(args.before)
    cp = compiled.main([])
    lines += [
        "## torch.compile(backend=\"tpu\") against eager and inductor",
        "",
        "The GPT above (model and `opt.step` compiled), training step and inference forward pass. Every",
        "configuration is built and warmed up first (`first` is its first call: it compiles, or loads from",
        f"the disk cache); then they run in turns, {cp['steps']} calls each per round, {cp['rounds']} rounds;",
        "tokens/s is the median round. Ratios: of the medians, with the lowest and highest round.",
        "",
        "| task | configuration | tokens/s | first (s) |",
        "| --- | --- | ---: | ---: |",
    ]
    for r in cp["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | {r['config']} | {r['error']} | |")
        else:
            lines.append(f"| {r['task']} | {r['config']} | {r['tokens_per_s']:.0f} | {r['first_s']:.2f} |")
    names = {"tpu strict eager": "strict eager", "CPU torch.compile (inductor)": "inductor on the CPU"}
    for task, against in cp["ratios"].items():
        parts = [f"compiled / {names[o]} {r['ratio']:.2f}x (rounds {r['low']:.2f}-{r['high']:.2f}x)"
                 for o, r in against.items()]
        lines.append(f"\n{task}: " + ", ".join(parts) + ".")
    lines.append("")
    lines += serving_section()
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
