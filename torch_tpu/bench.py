"""``torch-tpu bench``: your own workload on each target side by side, in cost per 1M tokens.

    torch-tpu bench --model gpt --task generate --batch 1,4 --devices tpu,cpu --modes strict,fused
    torch-tpu bench --config sweep.toml --price tpu=1.20,cpu=0.10 --max-latency-ms 50 --out results/
    torch-tpu bench --compare gpu_box.json tpu_box.json --out compared/
    torch-tpu bench --model titan:llama3:8B --project v5p:256 --project v7x:8192 --out projected/

A target is a device, a mode and a dtype; each runs in its own process, and the timed calls go in
alternating rounds (target after target, then again), so drift on a shared machine hits all alike.
Figures: throughput, latency p50/p90/p99, time to first token and inter-token latency
(generation), first-call time (compile), steady-state recompiles, peak device memory, MFU, and
cost per 1M tokens from the price per device-hour you give (never fetched from anywhere).
Writes bench.json, bench.csv, report.md, throughput.png and cost_latency.png to --out.
``--project CHIP:N`` runs nothing: it traces one training step of --model on fake ranks and
projects it onto N chips of TPU v5p, v6e or v7x (torch_tpu/scale.py, docs/scale.md), writing
projection.json to --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

# Dense bf16 peaks (FLOP/s) of devices by the name their plugin reports; extend with --peak.
KNOWN_PEAKS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA A100": 312e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA B200": 2250e12,
}
MODES_OFF_TPU = {"strict": "eager", "fused": None, "compile": "compile"}  # fused eager is tpu's own
DISAGREEMENT = 0.25  # rounds whose throughput differs more than this get a warning


class BenchError(Exception):
    """A bad argument or input: reported on one line, exit status 2."""


def parse_list(text, conv=str):
    if text is None:
        return None
    items = text if isinstance(text, list) else str(text).split(",")
    try:
        return [conv(str(i).strip()) for i in items if str(i).strip()]
    except ValueError as e:
        raise BenchError(f"cannot read {text!r}: {e}") from None


def parse_prices(text) -> dict:
    """'tpu=1.20,cuda=2.50' or a JSON/TOML file of {device: price per hour}."""
    if not text:
        return {}
    if os.path.isfile(text):
        try:
            if text.endswith(".toml"):
                import tomllib

                with open(text, "rb") as f:
                    data = tomllib.load(f)
            else:
                with open(text) as f:
                    data = json.load(f)
            data = data.get("prices", data)
            return {str(k): float(v) for k, v in data.items()}
        except Exception as e:  # noqa: BLE001 - any malformed file gets one message
            raise BenchError(f"prices file {text}: {type(e).__name__}: {e}") from None
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        try:
            if not sep:
                raise ValueError("expected device=price")
            out[k.strip()] = float(v)
        except ValueError as e:
            raise BenchError(f"--price {item!r}: {e} (write e.g. tpu=1.20,cpu=0.10)") from None
    return out


def load_config(path) -> dict:
    if not os.path.isfile(path):
        raise BenchError(f"config {path}: no such file")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            with open(path) as f:
                return yaml.safe_load(f) or {}
        import tomllib

        with open(path, "rb") as f:
            return tomllib.load(f)
    except Exception as e:  # noqa: BLE001
        raise BenchError(f"config {path}: {type(e).__name__}: {e}") from None


def available(device: str) -> bool:
    import torch

    kind = device.split(":")[0]
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "tpu":
        try:
            import torch_tpu  # noqa: F401

            return torch.tpu.device_count() > 0
        except Exception:  # noqa: BLE001
            return False
    return False


def targets_of(devices, modes, dtypes):
    out = []
    for d in devices:
        for m in modes:
            mode = m if d.startswith("tpu") else MODES_OFF_TPU.get(m, m)
            if mode is None:
                continue
            for dt in dtypes:
                t = (d, mode, dt)
                if t not in out:
                    out.append(t)
    return out


def points_of(cfg) -> list[dict]:
    task = cfg["task"]
    pts = []
    for b in cfg["batch"]:
        if task == "generate":
            for p in cfg["prompt_len"]:
                for n in cfg["new_tokens"]:
                    pts.append({"model": cfg["model"], "task": task, "batch": b, "prompt_len": p, "new_tokens": n})
        else:
            for s in cfg["seq_len"]:
                pts.append({"model": cfg["model"], "task": task, "batch": b, "seq_len": s})
                if task == "train":
                    pts[-1]["optimizer"] = cfg["optimizer"]
    return pts


class Worker:
    def __init__(self, device, mode, dtype):
        self.name = f"{device}/{mode}/{dtype}"
        self.device = device
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "torch_tpu._bench_worker", device, mode, dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, cmd: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"error": f"the {self.name} worker has died (status {self.proc.poll()})"}
        for line in self.proc.stdout:
            if line.startswith("@@bench "):
                return json.loads(line[len("@@bench "):])
        return {"error": f"the {self.name} worker has died (status {self.proc.wait()})"}

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask({"op": "exit"})
            except Exception:  # noqa: BLE001
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarise(point, target, setup, rounds, price, peak) -> dict:
    """One row: a point on a target, from its setup answer and its rounds' answers."""
    device, mode, dtype = target
    row = {**{k: v for k, v in point.items() if k != "model"}, "model": point["model"], "device": device,
           "mode": mode, "dtype": dtype}
    if "error" in setup:
        return {**row, "error": setup["error"]}
    bad = [r["error"] for r in rounds if "error" in r]
    if bad:
        return {**row, "error": bad[0]}
    per_round = [sum(c["tokens"] for c in r["calls"]) / sum(c["latency"] for c in r["calls"]) for r in rounds]
    lat = [c["latency"] * 1e3 for r in rounds for c in r["calls"]]
    ttft = [c["ttft"] * 1e3 for r in rounds for c in r["calls"] if c.get("ttft") is not None]
    itl = [x * 1e3 for r in rounds for c in r["calls"] for x in c.get("itl", [])]
    tps = statistics.median(per_round)
    row.update({
        "tokens_per_s": tps, "round_min": min(per_round), "round_max": max(per_round),
        "latency_p50_ms": percentile(lat, 0.5), "latency_p90_ms": percentile(lat, 0.9),
        "latency_p99_ms": percentile(lat, 0.99),
        "ttft_p50_ms": percentile(ttft, 0.5), "itl_p50_ms": percentile(itl, 0.5),
        "first_call_s": setup["first_s"], "compiles_first_call": setup["compiles"],
        "recompiles_steady": sum(r["recompiles"] for r in rounds),
        "peak_memory_mb": (max(r["peak_memory"] for r in rounds) / 2**20) if rounds[0]["peak_memory"] is not None
        else None,
        "params": setup["params"],
        "mfu": setup["flops_per_token"] * tps / peak if peak else None,
        "price_per_hour": price,
        "cost_per_1m_tokens": price / 3600 / tps * 1e6 if price is not None and tps > 0 else None,
        "rounds_disagree": max(per_round) / min(per_round) - 1 > DISAGREEMENT,
    })
    return row


def environment() -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "host": platform.node(), "cores": os.cpu_count()}
    from ._sysinfo import cpu_model

    env["cpu"] = cpu_model()
    try:
        import torch_tpu  # noqa: F401

        env["tpu_device"] = torch.tpu.get_device_name(0)
        from torch_tpu import _env

        env["plugin"] = _env.get("TORCH_TPU_PLUGIN", "auto")
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=here).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def device_peak(worker: Worker, device: str, user_peaks: dict, env: dict) -> tuple[float | None, str]:
    kind = device.split(":")[0]
    if kind in user_peaks:
        return user_peaks[kind], "--peak"
    name = env.get("tpu_device", "") if kind == "tpu" else ""
    for known, flops in KNOWN_PEAKS.items():
        if name.startswith(known):
            return flops, known
    if kind == "cpu" or name.startswith("cpu"):
        ans = worker.ask({"op": "peak"})
        if "flops" in ans:
            return ans["flops"], "measured float32 matmul"
    return None, "unknown"


def run(cfg: dict, progress=True) -> dict:
    for d in cfg["devices"]:
        if not available(d):
            raise BenchError(f"device {d!r} is not present here")
    targets = targets_of(cfg["devices"], cfg["modes"], cfg["dtypes"])
    points = points_of(cfg)
    env = environment()
    workers = {t: Worker(*t) for t in targets}
    rows = []
    try:
        peaks = {t: device_peak(workers[t], t[0], cfg["peaks"], env) for t in targets}
        total = len(points) * len(targets) * (cfg["rounds"] + 1)
        bar = _progress(total, progress)
        for point in points:
            setups = {}
            for t in targets:
                setups[t] = workers[t].ask({"op": "setup", "point": point, "warmup": cfg["warmup"]})
                bar.update(1)
            measured = {t: [] for t in targets}
            live = [t for t in targets if "error" not in setups[t]]
            for r in range(cfg["rounds"]):
                order = live[r % len(live):] + live[:r % len(live)] if live else []
                for t in order:
                    measured[t].append(workers[t].ask({"op": "measure", "calls": cfg["calls"]}))
                    bar.update(1)
            for t in targets:
                price = cfg["prices"].get(t[0].split(":")[0], cfg["prices"].get(t[0]))
                rows.append(summarise(point, t, setups[t], measured[t], price, peaks[t][0]))
                rows[-1]["peak_source"] = peaks[t][1]
        bar.close()
    finally:
        for w in workers.values():
            w.close()
    out = {"environment": env, "config": {k: v for k, v in cfg.items()}, "rows": rows}
    out["cheapest"] = cheapest(rows, cfg.get("max_latency_ms"))
    return out


def cheapest(rows, max_latency_ms):
    ok = [r for r in rows if r.get("cost_per_1m_tokens") is not None and
          (max_latency_ms is None or r["latency_p99_ms"] <= max_latency_ms)]
    if not ok:
        return None
    best = min(ok, key=lambda r: r["cost_per_1m_tokens"])
    return {k: best[k] for k in ("device", "mode", "dtype", "batch", "cost_per_1m_tokens", "latency_p99_ms")}


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total, on):
    if not on or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    except ImportError:
        return _NoBar()


COLUMNS = [("device", "{}"), ("mode", "{}"), ("dtype", "{}"), ("batch", "{}"), ("tokens_per_s", "{:.1f}"),
           ("latency_p50_ms", "{:.2f}"), ("latency_p99_ms", "{:.2f}"), ("ttft_p50_ms", "{:.2f}"),
           ("itl_p50_ms", "{:.2f}"), ("first_call_s", "{:.2f}"), ("recompiles_steady", "{}"), ("mfu", "{:.2%}"),
           ("cost_per_1m_tokens", "{:.4f}")]


def table(result) -> str:
    rows = result["rows"]
    head = [c for c, _ in COLUMNS]
    extra = [k for k in ("prompt_len", "new_tokens", "seq_len") if any(k in r for r in rows)]
    head = head[:4] + extra + head[4:]
    fmt = dict(COLUMNS)
    lines = []
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r.get(h, "")) if h in ("device", "mode", "dtype", "batch", *extra) else "" for h in head]
                        + [r["error"]])
            continue
        cells = []
        for h in head:
            v = r.get(h)
            cells.append("-" if v is None else fmt.get(h, "{}").format(v))
        body.append(cells + (["rounds disagree"] if r["rounds_disagree"] else [""]))
    head = head + ["note"]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for b in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)))
    if result.get("cheapest"):
        c = result["cheapest"]
        lines.append(f"cheapest per 1M tokens{' within the latency limit' if result['config'].get('max_latency_ms') else ''}: "
                     f"{c['device']}/{c['mode']}/{c['dtype']} batch {c['batch']}: {c['cost_per_1m_tokens']:.4f} "
                     f"(p99 {c['latency_p99_ms']:.1f} ms)")
    for r in rows:
        if r.get("rounds_disagree"):
            lines.append(f"warning: {r['device']}/{r['mode']}/{r['dtype']} batch {r['batch']}: rounds differ by more "
                         f"than {DISAGREEMENT:.0%} ({r['round_min']:.1f}-{r['round_max']:.1f} tokens/s); the machine is "
                         "busy or the workload is not steady")
    return "\n".join(lines) + "\n"


def write_outputs(result, out_dir) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    # Each CSV row carries where it was measured, so that rows pasted together stay attributable.
    env = result["environment"]
    flat_env = {} if result["rows"] and result["rows"][0].get("run") else \
        {f"env_{k}": env.get(k) for k in ("date", "host", "cpu", "torch", "tpu_device", "plugin", "commit")}
    rows = [{**r, **flat_env} for r in result["rows"]]
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    shown = plots(result, out_dir)
    env = result["environment"]
    envs = env.values() if result["rows"] and result["rows"][0].get("run") else [env]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(f"# torch-tpu bench: {result['config'].get('model')} {result['config'].get('task')}\n\n")
        for e in envs:
            f.write("- " + ", ".join(f"{k}: {v}" for k, v in e.items()) + "\n")
        f.write("\n```\n" + table(result) + "```\n\n![throughput](throughput.png)\n\n"
                "![cost per 1M tokens against p99 latency](cost_latency.png)\n")
    return shown


def _label(r, with_run=False):
    s = f"{r['device']} {r['mode']} {r['dtype']}"
    return f"{r['run']}: {s}" if with_run and r.get("run") else s


def plots(result, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    with_run = any(r.get("run") for r in rows)
    series = {}
    for r in rows:
        series.setdefault(_label(r, with_run), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in series.items():
        by_batch = {}
        for r in rs:
            by_batch.setdefault(r["batch"], []).append(r["tokens_per_s"])
        bs = sorted(by_batch)
        ax.plot(bs, [max(by_batch[b]) for b in bs], marker="o", label=name)
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"{result['config'].get('model')} {result['config'].get('task')}: throughput by batch size")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)
    shown = {"throughput.png": _described(ax)}
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    priced = False
    for name, rs in series.items():
        pts = sorted((r["latency_p99_ms"], r["cost_per_1m_tokens"]) for r in rs if r.get("cost_per_1m_tokens"))
        if pts:
            priced = True
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            for r in rs:
                if r.get("cost_per_1m_tokens"):
                    ax.annotate(f"b{r['batch']}", (r["latency_p99_ms"], r["cost_per_1m_tokens"]), fontsize=7,
                                textcoords="offset points", xytext=(4, 4))
    limit = result["config"].get("max_latency_ms")
    if limit:
        ax.axvline(limit, color="grey", linestyle="--", label=f"latency limit {limit} ms")
    ax.set_xlabel("p99 latency per call (ms)")
    ax.set_ylabel("cost per 1M tokens")
    ax.set_title("cost per 1M tokens against p99 latency" + ("" if priced else " (no --price given)"))
    ax.grid(True, alpha=0.3)
    if priced or limit:
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cost_latency.png"), dpi=110)
    shown["cost_latency.png"] = _described(ax)
    plt.close(fig)
    return shown


def _described(ax) -> dict:
    """What a plot shows: its title, axis labels, legend entries and the points of each line."""
    legend = ax.get_legend()
    return {"title": ax.get_title(), "x": ax.get_xlabel(), "y": ax.get_ylabel(),
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            "lines": {ln.get_label(): [list(map(float, p)) for p in ln.get_xydata()] for ln in ax.get_lines()
                      if not ln.get_label().startswith("_")}}


def compare(paths, out_dir=None) -> dict:
    rows, envs = [], {}
    cfg = None
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
            run_name = os.path.splitext(os.path.basename(p))[0]
            if run_name == "bench":
                run_name = os.path.basename(os.path.dirname(os.path.abspath(p)))
            envs[run_name] = data["environment"]
            cfg = cfg or data["config"]
            rows += [dict(r, run=run_name) for r in data["rows"]]
        except (OSError, ValueError, KeyError) as e:
            raise BenchError(f"--compare {p}: not a bench result ({type(e).__name__}: {e})") from None
    result = {"environment": envs, "config": cfg, "rows": rows,
              "cheapest": cheapest(rows, (cfg or {}).get("max_latency_ms"))}
    if out_dir:
        write_outputs(result, out_dir)
    return result


def build_config(args) -> dict:
    cfg = {"model": "gpt", "task": "generate", "batch": [1], "prompt_len": [16], "new_tokens": [16], "seq_len": [64],
           "devices": ["tpu", "cpu"], "modes": ["strict", "fused"], "dtypes": ["float32"], "rounds": 3, "calls": 5, "warmup": 2, "optimizer": "adamw",
           "prices": {}, "peaks": {}, "max_latency_ms": None}
    if args.config:
        file_cfg = load_config(args.config)
        unknown = set(file_cfg) - set(cfg) - {"price", "peak"}
        if unknown:
            raise BenchError(f"config {args.config}: unknown keys {', '.join(sorted(unknown))}")
        for k, v in file_cfg.items():
            if k in ("batch", "prompt_len", "new_tokens", "seq_len"):
                cfg[k] = parse_list(v, int)
            elif k in ("devices", "modes", "dtypes"):
                cfg[k] = parse_list(v)
            elif k in ("price", "prices"):
                cfg["prices"] = {str(a): float(b) for a, b in v.items()} if isinstance(v, dict) else parse_prices(v)
            elif k in ("peak", "peaks"):
                cfg["peaks"] = {str(a): float(b) for a, b in v.items()}
            else:
                cfg[k] = v
    for k in ("model", "task", "rounds", "calls", "warmup", "optimizer", "max_latency_ms"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    for k in ("batch", "prompt_len", "new_tokens", "seq_len"):
        if getattr(args, k) is not None:
            cfg[k] = parse_list(getattr(args, k), int)
    for k in ("devices", "modes", "dtypes"):
        if getattr(args, k) is not None:
            cfg[k] = parse_list(getattr(args, k))
    if args.price:
        cfg["prices"] = parse_prices(args.price)
    if args.peak:
        cfg["peaks"] = {k: v for k, v in parse_prices(args.peak).items()}
    if cfg["optimizer"] not in ("adamw", "adam", "sgd", "adafactor"):
        raise BenchError(f"--optimizer {cfg['optimizer']!r}: adamw, adam, sgd or adafactor")
    if cfg["task"] not in ("generate", "forward", "train"):
        raise BenchError(f"--task {cfg['task']!r}: generate, forward or train")
    for m in cfg["modes"]:
        if m not in ("strict", "fused", "compile"):
            raise BenchError(f"--modes {m!r}: strict, fused or compile")
    for d in cfg["dtypes"]:
        if d not in ("float32", "bfloat16", "float16"):
            raise BenchError(f"--dtypes {d!r}: float32, bfloat16 or float16")
    if any(v <= 0 for k in ("batch", "prompt_len", "new_tokens", "seq_len") for v in cfg[k]) or cfg["rounds"] < 1 \
            or cfg["calls"] < 1 or cfg["warmup"] < 0:
        raise BenchError("sizes, --rounds and --calls must be positive")
    m = cfg["model"]
    if not (m == "gpt" or m.startswith("gpt:") or m.startswith("hf:") or os.path.isdir(m)):
        raise BenchError(f"--model {m!r}: not gpt[:tiny|small|base], not hf:ARCH[:tiny|small], and no such folder")
    return cfg


def project(args) -> int:
    """--project CHIP:N (repeatable): the training step of --model (gpt[:size], hf:ARCH[:size], a
    folder, or titan:FAMILY:FLAVOR such as titan:llama3:8B) traced without compute and projected
    onto each CHIP:N; prints the table, writes projection.json to --out. Raises ValueError on a
    bad CHIP:N before anything is traced."""
    from . import scale

    for p in args.project:
        scale.parse_project(p)
    seq = parse_list(args.seq_len, int)
    batch = parse_list(args.batch, int)
    result = scale.run(args.model or "gpt", args.project, seq_len=seq[0] if seq else None,
                       batch=batch[0] if batch else None)
    out = args.out or "bench-results"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "projection.json"), "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.write(scale.table(result["rows"]))
    print(f"a projection from the traced step, not a measurement (docs/scale.md); written: {out}/projection.json")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torch-tpu bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a TOML or YAML file with the sweep (the options below override it)")
    ap.add_argument("--model", help="gpt[:tiny|small|base], hf:ARCH[:tiny|small] (random weights, offline), "
                    "or a local Hugging Face model folder")
    ap.add_argument("--task", help="generate (default), forward or train")
    ap.add_argument("--batch", help="batch sizes, comma-separated")
    ap.add_argument("--prompt-len", dest="prompt_len", help="prompt lengths (generate)")
    ap.add_argument("--new-tokens", dest="new_tokens", help="output lengths (generate)")
    ap.add_argument("--seq-len", dest="seq_len", help="sequence lengths (forward, train)")
    ap.add_argument("--optimizer", help="train: adamw (default), adam, sgd or adafactor")
    ap.add_argument("--devices", help="e.g. tpu,cpu (cuda where present)")
    ap.add_argument("--modes", help="strict,fused,compile (off tpu: strict is eager, compile is inductor)")
    ap.add_argument("--dtypes", help="float32,bfloat16")
    ap.add_argument("--rounds", type=int, help="alternating rounds (default 3)")
    ap.add_argument("--calls", type=int, help="timed calls per target per round (default 5)")
    ap.add_argument("--warmup", type=int, help="untimed calls after the first, before the rounds (default 2)")
    ap.add_argument("--price", help="price per device-hour: tpu=1.20,cuda=2.50, or a JSON/TOML file")
    ap.add_argument("--peak", help="peak FLOP/s per device for MFU: tpu=197e12 (default: known peaks, or measured "
                    "for the CPU)")
    ap.add_argument("--max-latency-ms", dest="max_latency_ms", type=float,
                    help="name the cheapest target whose p99 latency per call is within this")
    ap.add_argument("--out", help="folder for bench.json, bench.csv and the plots (default: bench-results)")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="put earlier results side by side instead of running")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--project", action="append", metavar="CHIP:N",
                    help="project --model's training step onto N chips of v5p, v6e or v7x instead of running it "
                    "(repeatable; --model may also be titan:llama3:8B, titan:qwen3:8B; docs/scale.md)")
    args = ap.parse_args(argv)
    if args.project:
        try:
            return project(args)
        except (ValueError, BenchError) as e:
            print(f"torch-tpu bench: {e}", file=sys.stderr)
            return 2
    try:
        if args.compare:
            result = compare(args.compare, args.out or "bench-compare")
            sys.stdout.write(table(result))
            return 0
        cfg = build_config(args)
        result = run(cfg, progress=not args.no_progress)
    except BenchError as e:
        print(f"torch-tpu bench: {e}", file=sys.stderr)
        return 2
    out = args.out or "bench-results"
    write_outputs(result, out)
    sys.stdout.write(table(result))
    print(f"written: {out}/bench.json, bench.csv, report.md, throughput.png, cost_latency.png")
    failed = [r for r in result["rows"] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
