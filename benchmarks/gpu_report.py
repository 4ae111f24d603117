#!/usr/bin/env python3
"""The tables of a scripts/gpu_check.sh run, in markdown, from the JSON files it wrote:

    python benchmarks/gpu_report.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def load(out: str, name: str):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def op_table(data) -> list:
    ref = data.get("ref", "cpu")
    lines = [f"\n### Per-op time, strict eager (us per op, {data['size']}x{data['size']} float32)\n",
             f"| op | {ref} eager | tpu strict | tpu / {ref} |", "|---|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['op']} | {r['ref_us']:.1f} | {r['tpu_us']:.1f} | {r['ratio']:.2f}x |")
    ratios = [r["ratio"] for r in data["rows"]]
    lines.append(f"\nMedian tpu / {ref}: {statistics.median(ratios):.2f}x")
    return lines


def rows_table(title: str, data, unit_key: str, unit: str, ratio_of: str) -> list:
    lines = [f"\n### {title}\n", f"| configuration | {unit} | first call (s) | vs {ratio_of} |", "|---|---:|---:|---:|"]
    rows = data["rows"]
    base = next((r for r in rows if r["config"] == ratio_of and unit_key in r), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} | | |")
            continue
        rel = f"{r[unit_key] / base[unit_key]:.2f}x" if base else ""
        lines.append(f"| {r['config']} | {r[unit_key]:.0f} | {r['first_s']:.1f} | {rel} |")
    for task_or_name, rs in data.get("ratios", {}).items():
        if isinstance(rs, dict) and "ratio" not in rs:  # compiled.py: task -> other -> summary
            for other, s in rs.items():
                lines.append(f"\ncompiled tpu / {other}: {s['ratio']:.2f}x (rounds {s['low']:.2f}-{s['high']:.2f}x)")
        else:
            lines.append(f"\ncompiled tpu / {task_or_name}: {rs['ratio']:.2f}x (rounds {rs['low']:.2f}-{rs['high']:.2f}x)")
    return lines


def main(argv=None) -> int:
    out = (argv or sys.argv[1:])[0]
    lines = []
    if data := load(out, "op_overhead.json"):
        lines += op_table(data)
    if data := load(out, "gpt_train.json"):
        ref = next(r["config"] for r in data["rows"] if "inductor" in r["config"])
        m = data.get("model", {})
        title = "GPT training step (tokens/s)" + (f", {m}" if m else "")
        lines += rows_table(title, data, "tokens_per_s", "tokens/s", ref)
    if data := load(out, "hf_generate.json"):
        ref = next(r["config"] for r in data["rows"] if "inductor" in r["config"])
        a = data.get("args", {})
        title = ("Hugging Face generation, greedy (new tokens/s), Llama-shaped, "
                 f"hidden {a.get('hidden')}, {a.get('layers')} layers, batch {a.get('batch')}, "
                 f"{a.get('new_tokens')} new tokens")
        lines += rows_table(title, data, "new_tokens_per_s", "new tokens/s", ref)
        same = {r["config"]: r.get("same_tokens_as_ref_eager") for r in data["rows"] if "error" not in r}
        lines.append(f"\nSame tokens as the reference's eager: {same}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
