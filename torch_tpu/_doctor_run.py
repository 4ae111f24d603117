"""The run mode of ``torch-tpu doctor --run script.py args...``: runs the script in this process
on tpu and writes what a port needs to know as JSON (argv[1]), even when the script raises:
ops that fell back to the CPU with the user's line that first called each, compiles and their
reasons, graph breaks, device-to-host reads (each one a host sync), and the ops that took the
most time. The doctor starts this module in a child process and prints the report."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
import warnings


def _user_frame(stack):
    for fs in reversed(stack):
        f = fs.filename.replace(os.sep, "/")
        if "/torch/" not in f and "/torch_tpu/" not in f and not f.startswith("<frozen") and \
                not f.endswith("/_doctor_run.py") and "/runpy.py" not in f and "/warnings.py" not in f:
            return f"{fs.filename}:{fs.lineno}"
    return None


def main(argv) -> int:
    out_path, script, *args = argv
    import torch
    import torch_tpu

    fallback_sites: dict[str, str] = {}
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith("torch_tpu: ") and " has no tpu lowering" in text:
            op = text[len("torch_tpu: "):text.index(" has no tpu lowering")]
            fallback_sites.setdefault(op, _user_frame(traceback.extract_stack()) or f"{filename}:{lineno}")
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.simplefilter("always", UserWarning)
    torch_tpu.reset_metrics()
    report = {"script": script, "args": args, "exit": 0, "error": None}
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    t0 = time.perf_counter()
    try:
        with prof:
            runpy.run_path(script, run_name="__main__")
        torch.tpu.synchronize()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        report["exit"] = code
    except BaseException as e:  # the script's own failure is part of the report
        tb = traceback.extract_tb(e.__traceback__)
        report["exit"] = 1
        report["error"] = {"type": type(e).__name__, "message": str(e), "at": _user_frame(tb)}
    report["seconds"] = time.perf_counter() - t0
    m = torch_tpu.metrics()
    report["fallbacks"] = [{"op": op, "calls": n, "first_call": fallback_sites.get(op)}
                           for op, n in sorted(m["fallbacks"].items(), key=lambda kv: -kv[1])]
    report["compiles"] = {"count": m["compiles"], "seconds": m["compile_seconds"], "from_disk_cache": m["disk_hits"],
                          "by_op": dict(sorted(m["compiles_by_op"].items(), key=lambda kv: -kv[1])[:20]),
                          "reasons": m["recompile_reasons"][-20:]}
    report["host_reads"] = {"count": m["d2h_transfers"], "bytes": m["d2h_bytes"]}
    report["executions"] = m["executions"]
    breaks = []
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        breaks = [{"reason": r, "count": n} for r, n in counters["graph_break"].most_common(20)]
    report["graph_breaks"] = breaks
    try:
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        report["top_ops"] = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                             for e in rows if e.key.startswith("aten::")][:15]
    except Exception:  # no profile when the script failed before its first op
        report["top_ops"] = []
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return report["exit"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
