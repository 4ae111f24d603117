#!/usr/bin/env python
"""Merges OpInfo sweep results (tools/opinfo_sweep.py, one file per shard) into
docs/op_coverage.json (per (variant, dtype) status and message) and docs/op_coverage.md
(counts, native-pass percentages, missing lowerings, failures grouped, per-op table).

    python tools/op_coverage_report.py /tmp/sweep/shard0.json /tmp/sweep/shard1.json
"""

from __future__ import annotations


import argparse
import json
import os
import re
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opinfo_tolerances  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("float32", "bfloat16", "int64", "bool", "grad")
STATUSES = ("native_pass", "fallback_pass", "mismatch", "error", "crash", "skip")
CODE = {"native_pass": "ok", "fallback_pass": "fb", "mismatch": "**MIS**", "error": "**ERR**",
        "crash": "**CRASH**", "skip": "skip"}


def load(paths):
    metas, results = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        for rec in data["results"]:
            results[rec["key"]] = rec
    return metas, results


def column(rec):
    return "grad" if rec["kind"] == "grad" else rec["dtype"]


def base_status(rec):
    s = rec["status"]
    return s[5:] if s.startswith("grad_") else s


def normalise(msg: str) -> str:
    """A message with its argument lists, numbers, shapes and quoted values blanked, for
    grouping."""
    msg = re.sub(r"^(out|grad)(\[[^\]]*\])*: ", "", msg)
    msg = re.sub(r"(aten::[\w.]+)\([^)]*\)", r"\1(…)", msg)
    msg = re.sub(r"'(aten::[\w.]+)'", r"\1", msg)
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"\[[0-9, ]*\]|\([0-9, ]*\)", "[…]", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", msg)
    msg = msg.split("; ")[0]
    msg = msg.split(" This could be because")[0]
    return msg[:200]


def mismatch_kind(e) -> str:
    msg = e.get("message", "")
    if msg.startswith("CPU raised"):
        return "tpu returned a value where the CPU raised"
    if "is on the cpu" in msg:
        return "result left on the cpu"
    if "attribute" in msg or "expected a Tensor" in msg or "expected tuple" in msg \
            or "expected list" in msg or "dict keys" in msg:
        return "wrong shape, dtype or structure"
    if e.get("loose_close"):
        return "precision only (close at rtol=atol=1e-3 for float32, 5e-2 for bfloat16)"
    return "wrong values"


def named_ops(msg: str):
    """aten ops named in an error message."""
    return set(re.findall(r"aten::[\w.]+", msg))


def pct(num, den):
    return f"{100.0 * num / den:.1f}%" if den else "n/a"


def build(metas, results):
    by_variant = defaultdict(dict)
    for rec in results.values():
        entry = {k: v for k, v in rec.items() if k not in ("variant", "dtype", "kind", "key")}
        by_variant[rec["variant"]][column(rec)] = entry
    meta = {
        "date": max(m["date"] for m in metas),
        "commit": metas[0]["commit"],
        "dirty": any(m.get("dirty") for m in metas),
        "extension_sha256": sorted({m.get("extension_sha256", "") for m in metas}),
        "machine": metas[0]["machine"],
        "shards": [m["shard"] for m in metas],
        "max_samples": metas[0]["max_samples"],
        "timeout_s": metas[0].get("timeout_s"),
        "elapsed_s": {m["shard"]: m["elapsed_s"] for m in metas},
    }
    return meta, dict(sorted(by_variant.items()))


def summary(by_variant):
    counts = {c: Counter() for c in COLUMNS}
    for cols in by_variant.values():
        for c, e in cols.items():
            counts[c][e["status"][5:] if e["status"].startswith("grad_") else e["status"]] += 1
    return counts


def missing_lowerings(by_variant):
    """aten op -> (variants affected, units affected), from the fallback counters and from
    "Could not run 'aten::X'" errors (no kernel at all, e.g. sparse layouts)."""
    variants, units = defaultdict(set), Counter()
    for v, cols in by_variant.items():
        for e in cols.values():
            ops = set(e.get("fallbacks", {}))
            if e["status"].endswith("error") and "Could not run" in e.get("message", ""):
                ops |= named_ops(e["message"])
            for op in ops:
                variants[op].add(v)
                units[op] += 1
    return sorted(((op, len(vs), units[op]) for op, vs in variants.items()),
                  key=lambda t: (-t[1], -t[2], t[0]))


def broken_lowerings(by_variant):
    """aten op -> variants, for errors raised by a tpu lowering ("torch_tpu: aten::X(...)")."""
    variants = defaultdict(set)
    for v, cols in by_variant.items():
        for e in cols.values():
            if e["status"].endswith("error"):
                m = re.match(r"\w+: torch_tpu: (aten::[\w.]+)\(", e.get("message", ""))
                if m:
                    variants[m.group(1)].add(v)
    return sorted(variants.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def failures(by_variant, status):
    out = []
    for v, cols in by_variant.items():
        for c in COLUMNS:
            e = cols.get(c)
            if e and base_status(dict(e, kind="grad" if c == "grad" else "fwd")) == status:
                out.append((v, c, e))
    return out


def write_md(path, meta, by_variant):
    counts = summary(by_variant)
    lines = []
    w = lines.append
    m = meta["machine"]
    w("# tpu op coverage over PyTorch's OpInfo database")
    w("")
    w("Generated by `tools/opinfo_sweep.py` + `tools/op_coverage_report.py` "
      "(machine-readable: `docs/op_coverage.json`).")
    w("")
    w(f"- date: {meta['date']}")
    w(f"- commit: `{meta['commit'][:12]}`"
      + (" (with uncommitted changes)" if meta["dirty"] else "")
      + (f", extension sha256 `{', '.join(x for x in meta['extension_sha256'] if x)}`"
         if any(meta["extension_sha256"]) else ""))
    w(f"- machine: {m.get('cpu')} ({m.get('cores')} cores), {m.get('platform')}, "
      f"Python {m.get('python')}, torch {m.get('torch')}, PJRT plugin: {m.get('plugin')}")
    w(f"- at most {meta['max_samples']} sample inputs per (op, dtype); "
      f"hang timeout {meta['timeout_s']} s per sample; shards {', '.join(meta['shards'])}, "
      f"wall time per shard: "
      + ", ".join(f"{k}: {v / 60:.1f} min" for k, v in meta["elapsed_s"].items()))
    w(f"- {len(by_variant)} OpInfo variants; dtypes that the OpInfo does not support on the "
      "CPU are not run")
    w("")
    w("Statuses: `native_pass` (matches the CPU, no CPU fallback), `fallback_pass` (matches, "
      "but some op ran through the CPU fallback), `mismatch` (wrong result, or a value where "
      "the CPU raised), `error` (tpu raised where the CPU succeeded), `crash` (the process "
      "died or hung), `skip` (the CPU reference fails on every sample). Grad: gradients of "
      "the sum of the float outputs, float32.")
    w("")
    meta_only = sorted(v for v, cols in by_variant.items()
                       if any(e.get("meta_only") for e in cols.values()))
    ties = sorted(f"{v} ({c})" for v, cols in by_variant.items() for c, e in cols.items()
                  if e.get("notes"))
    w("How: each sample input is made on the CPU and copied to tpu (views keep their "
      "storage, offset and strides; tensors that the OpInfo keeps on the CPU for other "
      "devices stay there), the op runs on both, and the results are compared with "
      "`torch.testing.assert_close` at its default tolerances (equal_nan). Random or "
      "uninitialised results are compared on shapes and dtypes only: "
      + ", ".join(meta_only) + ", and dropout samples of scaled_dot_product_attention and "
      "multi_head_attention_forward. sort/argsort (stable=False) and topk accept "
      "indices of equal values in another order, and mode/kthvalue any index of the selected value "
      "(PyTorch leaves both unspecified)"
      + (f" (needed by: {', '.join(ties)})." if ties else "."))
    w("")
    w("## Summary")
    w("")
    w("| status | " + " | ".join(COLUMNS) + " |")
    w("| --- | " + " | ".join("---:" for _ in COLUMNS) + " |")
    for s in STATUSES:
        w(f"| {s} | " + " | ".join(str(counts[c][s]) for c in COLUMNS) + " |")
    w("| total | " + " | ".join(str(sum(counts[c].values())) for c in COLUMNS) + " |")
    runnable = {c: sum(counts[c].values()) - counts[c]["skip"] for c in COLUMNS}
    w("| **native pass %** (of status != skip) | "
      + " | ".join(f"**{pct(counts[c]['native_pass'], runnable[c])}**" for c in COLUMNS) + " |")
    w("| pass % incl. fallback | " + " | ".join(
        pct(counts[c]['native_pass'] + counts[c]['fallback_pass'], runnable[c]) for c in COLUMNS)
      + " |")
    w("")
    fwd_total = sum(runnable[c] for c in COLUMNS[:-1])
    fwd_native = sum(counts[c]["native_pass"] for c in COLUMNS[:-1])
    w(f"All forward dtypes together: {fwd_native} of {fwd_total} runnable (variant, dtype) "
      f"pairs pass natively ({pct(fwd_native, fwd_total)}). Gradients (float32): "
      f"{counts['grad']['native_pass']} of {runnable['grad']} differentiable variants pass "
      f"natively ({pct(counts['grad']['native_pass'], runnable['grad'])}), "
      f"{counts['grad']['fallback_pass']} more through the CPU fallback.")
    w("")

    miss = missing_lowerings(by_variant)
    w("## Missing lowerings (CPU fallbacks)")
    w("")
    w("ATen ops that ran through the CPU fallback (or have no kernel at all: \"Could not "
      "run\" errors), by the number of variants affected (any dtype or grad).")
    w("")
    w("| aten op | variants | units |")
    w("| --- | ---: | ---: |")
    for op, nv, nu in miss:
        w(f"| `{op}` | {nv} | {nu} |")
    w("")

    broken = broken_lowerings(by_variant)
    w("## Lowerings that raise")
    w("")
    w("ATen ops whose tpu lowering raised (see Errors for the messages).")
    w("")
    if not broken:
        w("None.")
    for op, vs in broken:
        w(f"- `{op}`: {len(vs)} variants: {', '.join(sorted(vs))}")
    w("")

    for status, title in (("crash", "Crashes"), ("error", "Errors"), ("mismatch", "Mismatches")):
        rows = failures(by_variant, status)
        w(f"## {title} ({len(rows)})")
        w("")
        if not rows:
            w("None.")
            w("")
            continue
        groups = defaultdict(list)
        for v, c, e in rows:
            key = mismatch_kind(e) if status == "mismatch" else normalise(e.get("message", ""))
            groups[key].append(f"{v} ({c})")
        w("Grouped by kind:" if status == "mismatch" else "Grouped by message:")
        w("")
        for msg, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            w(f"- {len(items)} × `{msg}`: " + ", ".join(items[:40])
              + (f", … {len(items) - 40} more" if len(items) > 40 else ""))
        w("")
        w("By op:")
        w("")
        per_op = defaultdict(list)
        for v, c, e in rows:
            per_op[v].append((c, e))
        for v, items in per_op.items():
            w(f"- **{v}**")
            for c, e in items:
                extra = ""
                if e.get("loose_close"):
                    extra = " (close at rtol=atol=1e-3 for float32 / 5e-2 for bfloat16)"
                if e.get("fallbacks"):
                    extra += " [fallbacks: " + ", ".join(sorted(e["fallbacks"])) + "]"
                if e.get("samples"):
                    extra += " (samples: " + ", ".join(
                        f"{k} {n}" for k, n in sorted(e["samples"].items())) + ")"
                msg = e.get("message", "").replace("`", "'")
                w(f"  - {c}: `{msg}`{extra}")
                cause = opinfo_tolerances.known_cause(v, c) if status == "mismatch" else None
                if cause:
                    w(f"    - cause: {cause}")
        w("")

    overrides = [(v, c, e["tolerance_override"]) for v, cols in by_variant.items() for c, e in cols.items()
                 if e.get("tolerance_override")]
    w(f"## Tolerance overrides ({len(overrides)})")
    w("")
    w("Units compared at a wider tolerance than PyTorch's default (table: `tools/opinfo_tolerances.py`).")
    w("")
    for v, c, why in overrides:
        w(f"- {v} ({c}): {why}")
    w("")

    skips = failures(by_variant, "skip")
    w(f"## Skips ({len(skips)})")
    w("")
    w("The CPU reference raises on every sample; tpu raised too unless noted.")
    w("")
    for v, c, e in skips:
        note = "" if e.get("tpu_raised", True) else " — **tpu did not raise**"
        w(f"- {v} ({c}): `{e.get('message', '').replace('`', chr(39))}`{note}")
    w("")

    w("## Per op")
    w("")
    w("`ok` native pass, `fb` passes through the CPU fallback, `MIS` mismatch, `ERR` error, "
      "`CRASH` crash, `skip` CPU reference fails, `-` dtype not supported on the CPU.")
    w("")
    w("| variant | " + " | ".join(COLUMNS) + " |")
    w("| --- | " + " | ".join(":---:" for _ in COLUMNS) + " |")
    for v, cols in by_variant.items():
        cells = []
        for c in COLUMNS:
            e = cols.get(c)
            if e is None:
                cells.append("-")
            else:
                s = e["status"][5:] if e["status"].startswith("grad_") else e["status"]
                cells.append(CODE[s])
        w(f"| {v} | " + " | ".join(cells) + " |")
    w("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result files of tools/opinfo_sweep.py")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "docs", "op_coverage.json"))
    p.add_argument("--md", default=os.path.join(REPO_ROOT, "docs", "op_coverage.md"))
    args = p.parse_args(argv)
    metas, results = load(args.results)
    meta, by_variant = build(metas, results)
    with open(args.json, "w") as f:  # one line per variant: small, readable diffs
        f.write('{"meta": ' + json.dumps(meta) + ',\n"results": {\n')
        f.write(",\n".join(json.dumps(v) + ": " + json.dumps(cols)
                           for v, cols in by_variant.items()))
        f.write("\n}}\n")
    write_md(args.md, meta, by_variant)
    counts = summary(by_variant)
    for c in COLUMNS:
        run = sum(counts[c].values()) - counts[c]["skip"]
        print(f"{c:9s} native {pct(counts[c]['native_pass'], run):>6s}  "
              + " ".join(f"{s}={counts[c][s]}" for s in STATUSES))
    print(f"wrote {args.json} and {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
