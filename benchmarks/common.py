"""Helpers shared by the benchmarks: timing with warm-up, and the run's
provenance (date, machine, commit) for docs/benchmarks.md."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_tpu  # noqa: E402,F401
from torch_tpu._sysinfo import cpu_model  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("tpu"):
        torch.tpu.synchronize()
    elif device.startswith("cuda"):
        torch.cuda.synchronize()


def time_per_call(fn, device: str, warmup: int = 5, iters: int = 50, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call of `fn` (device
    work included: the timer stops after a synchronize)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def optimizer_step(model_loss, opt):
    """One training step: the loss `model_loss()` computes, backward, the optimizer's step."""
    loss = model_loss()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def timed_steps(step, warmup: int, steps: int, before=lambda: None) -> float:
    """Seconds for `steps` calls of `step(i)` (returning a loss) after `warmup` calls, each warm-up
    loss read back; `before()` runs just before the clock starts (a barrier across ranks)."""
    for i in range(warmup):
        step(i).item()
    before()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    loss.item()
    return time.perf_counter() - t0


def interleaved(runs: dict, steps: int, rounds: int = 5) -> dict:
    """Seconds per call of each run, taken in turns: every round times `steps`
    calls of each run one after the other, so a slow spell of a shared machine
    falls on all of them alike. `runs` maps a name to (fn, context, device):
    `context()` is entered around the calls (a mode). Returns name -> the
    per-round seconds per call."""
    out = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, context, device) in runs.items():
            with context():
                t0 = time.perf_counter()
                for _ in range(steps):
                    r = fn()
                if isinstance(r, torch.Tensor):
                    r.cpu()
                sync(device)
                out[name].append((time.perf_counter() - t0) / steps)
    return out


def mode_configs(ref: str = "cpu") -> list:
    """(name, device, mode, compile backend) for a side-by-side run: tpu's three modes, then the
    reference device's eager and inductor. The compiled tpu entry is third and inductor last
    (the ratios use them)."""
    label = ref.upper()
    return [
        ("tpu strict eager", "tpu", "strict", None),
        ("tpu fused eager", "tpu", "fused", None),
        ("tpu torch.compile(backend='tpu')", "tpu", "strict", "tpu"),
        (f"{label} eager", ref, "strict", None),
        (f"{label} torch.compile (inductor)", ref, "strict", "inductor"),
    ]


def ratio_summary(fast: list, slow: list) -> dict:
    """The speed-up of `fast` over `slow` (per-round seconds): the ratio of the
    medians, with the lowest and highest per-round ratio."""
    per_round = [s / f for f, s in zip(fast, slow)]
    return {"ratio": statistics.median(slow) / statistics.median(fast), "low": min(per_round),
            "high": max(per_round)}


def provenance() -> dict:
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         cwd=os.path.dirname(os.path.abspath(__file__))).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)))
        if dirty:
            commit += "+dirty"
    except Exception:
        commit = "unknown"
    cpu = cpu_model()
    gpu = {}
    if torch.cuda.is_available():
        gpu = {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    return {
        **gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "commit": commit,
        "torch": torch.__version__,
        "plugin": f"{torch_tpu._C._platform()} ({os.path.basename(torch_tpu._C._plugin_path())})",
    }


def write_json(path, out: dict) -> None:
    """Writes a benchmark's results where --json points (nothing without it)."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def write_markdown(path, lines: list, echo: bool = False) -> str:
    """Joins a report's lines; prints it when asked, writes it where path points (nothing without)."""
    text = "\n".join(lines) + "\n"
    if echo:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def collective_args(argv, max_mb: int):
    """The collective benchmarks' options: --max-mb (largest message), --rounds, --markdown."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mb", type=int, default=max_mb)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", default=None)
    return ap.parse_args(argv)


def message_sizes(max_mb: int) -> list:
    """Message sizes from 1 KiB to max_mb MiB: x8 steps below 1 MiB, x4 above."""
    sizes, s = [], 1024
    while s <= max_mb * 1024 * 1024:
        sizes.append(s)
        s *= 8 if s < 1024 * 1024 else 4
    return sizes


def busbw_factors(n: int) -> dict:
    """NCCL-tests' bus bandwidth factors for n ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}


def write_collective_report(path, intro: list, header: list, rows: list, row_line, ratio_label: str) -> None:
    """A collective benchmark's markdown: intro, provenance, the table (header lines, then
    row_line(row) per row), and the median of the rows' 'ratio'."""
    lines = [*intro, "", *provenance_lines(provenance()), "", *header, *(row_line(r) for r in rows), "",
             median_ratio_line(ratio_label, [r["ratio"] for r in rows])]
    write_markdown(path, lines)


def median_ratio_line(label: str, ratios: list) -> str:
    return (f"Median time ratio {label}: {statistics.median(ratios):.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}x).")


def provenance_lines(prov: dict) -> list:
    """The run's provenance as markdown list items, for the docs the benchmarks write."""
    gpu = [f"- GPU: {prov['gpu']} (CUDA {prov['cuda']})"] if "gpu" in prov else []
    return [f"- date: {prov['date']}", f"- machine: {prov['machine']}", *gpu, f"- commit: {prov['commit']}",
            f"- torch {prov['torch']}, PJRT plugin {prov['plugin']}"]
