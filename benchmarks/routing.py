"""Cache-aware against round-robin routing over vLLM servers on tpu: a shared-prefix workload
(a few long system prompts, many requests each with a short distinct user suffix, in random
order, a fixed number in flight) sent through sglang-router to 2 tpu vLLM workers, once per
policy, in one run. The same workers serve every policy; before each, every worker's prefix
cache is emptied (vLLM's POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1) and a new
router is started with that policy. Measured per policy: the workers' prefix-cache hit rate
(deltas of vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, in tokens), time to
first token p50/p99 (streamed requests, at the client), output tokens/s, requests per worker
(deltas of vllm:request_success_total). Prints a Markdown table.

The KV cache of each worker is small on purpose (--kv-cache-tokens, default 2048 tokens: about
three of the four system prompts and the requests in flight), as a server's cache is next to
its traffic in production; --kv-cache-tokens 0 leaves vLLM's size (1 GiB here, 131072 tokens:
every prompt fits everywhere, and round-robin only pays each prefix once per worker).

Run in the serving environment with the router (scripts/setup_routing.sh):
    .venv-vllm/bin/python benchmarks/routing.py [--requests 64] [--concurrency 8] [--out FILE]
"""
import argparse
import concurrent.futures as cf
import datetime
import http.client
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from vllm_models import make_model  # noqa: E402
from vllm_server import free_port, serving, write_report  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog hello world this is tiny model for testing vllm serves models "
         "on many devices including tpu and cpu paged attention stores keys values in blocks").split()


def get(port, path, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def post(port, path, body=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def counters(port):
    """The worker's prefix-cache hits and queries (tokens) and finished requests."""
    status, text = get(port, "/metrics")
    assert status == 200, text[:500]
    out = {"hits": 0.0, "queries": 0.0, "requests": 0.0}
    names = {"vllm:prefix_cache_hits_total{": "hits", "vllm:prefix_cache_queries_total{": "queries",
             "vllm:request_success_total{": "requests"}
    for line in text.splitlines():
        for prefix, key in names.items():
            if line.startswith(prefix):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def stream_one(port, prompt, max_tokens, timeout=300):
    """(time to first token s, completion tokens, total s) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        ttft, tokens = None, 0
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return ttft, tokens, time.perf_counter() - t0
    finally:
        conn.close()


def workload(tok, n_system, system_len, n_requests, seed):
    """n_requests prompts over n_system system prompts of about system_len tokens, each with its
    own short user turn, shuffled."""
    rng = random.Random(seed)
    systems = []
    for i in range(n_system):
        words = [f"system prompt {i}:"]
        while len(tok(" ".join(words)).input_ids) < system_len:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words))
    prompts = []
    for j in range(n_requests):
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        prompts.append(f"{systems[j % n_system]}\nuser {j}: {user}\nassistant:")
    rng.shuffle(prompts)
    return systems, prompts


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_router(policy, worker_urls, log_path):
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics), "--log-level", "warn", "--shutdown-grace-period-secs", "5"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            status, text = get(port, "/workers", timeout=5)
            if status == 200 and {w["url"] for w in json.loads(text)["workers"] if w["is_healthy"]} >= set(worker_urls):
                return proc, port
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"the router did not register its workers: {open(log_path).read()[-2000:]}")
        time.sleep(0.5)


def stop_router(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_policy(policy, worker_ports, prompts, args, work, name):
    for p in worker_ports:  # every worker starts cold
        status, text = post(p, "/reset_prefix_cache")
        assert status == 200 and json.loads(text)["success"], (p, status, text)
    router, port = start_router(policy, [f"http://127.0.0.1:{p}" for p in worker_ports],
                                os.path.join(work, f"router_{name}.log"))
    try:
        before = [counters(p) for p in worker_ports]
        t0 = time.perf_counter()
        results, errors = [], []
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(stream_one, port, p, args.max_tokens) for p in prompts]
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001  (counted and shown)
                    errors.append(repr(e))
        wall = time.perf_counter() - t0
        after = [counters(p) for p in worker_ports]
    finally:
        stop_router(router)
    d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits, queries = sum(x["hits"] for x in d), sum(x["queries"] for x in d)
    ttfts = [r[0] * 1000 for r in results if r[0] is not None]
    return {"policy": policy, "wall_s": wall, "errors": errors, "requests_per_worker": [int(x["requests"]) for x in d],
            "hit_rate": hits / queries if queries else float("nan"), "hits": hits, "queries": queries,
            "per_worker_hit_rate": [x["hits"] / x["queries"] if x["queries"] else float("nan") for x in d],
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "output_tok_s": sum(r[1] for r in results) / wall, "completed": len(results)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--rounds", type=int, default=2, help="each round runs every policy (order alternating)")
    # The workload (system-len: tokens per system prompt) and the servers' limits.
    for name, default in (("system-prompts", 4), ("system-len", 500), ("requests", 128), ("concurrency", 8),
                          ("max-tokens", 16), ("max-num-seqs", 8), ("max-model-len", 1024)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--kv-cache-tokens", type=int, default=2048,
                    help="each worker's KV cache in tokens (0: vLLM's default size, 1 GiB here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    work = tempfile.mkdtemp(prefix="routing_bench_")
    # benchmarks/serving.py's model: Qwen3-type, 4 layers, width 512, 8 heads and 4 kv heads of 64.
    model = make_model(os.path.join(work, "model"), "qwen3", layers=4, width=512, heads=8, kv_heads=4,
                       max_len=args.max_model_len)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # float32 K and V
    tok = AutoTokenizer.from_pretrained(model)
    systems, prompts = workload(tok, args.system_prompts, args.system_len, args.requests, args.seed)
    prompt_tokens = [len(tok(p).input_ids) for p in prompts]
    _, warm_prompts = workload(tok, args.system_prompts, args.system_len, 2 * args.concurrency, args.seed + 1000)

    server_args = ["--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
                   "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_tokens:
        server_args += ["--kv-cache-memory-bytes", str(args.kv_cache_tokens * token_bytes)]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # vLLM's /reset_prefix_cache
    runs = []
    t_start = time.time()
    with ExitStack() as stack:
        # One after the other: the second reads what the first compiled from torch_tpu's disk cache.
        ports = [stack.enter_context(serving(model, server_args, env, os.path.join(work, f"worker{i}.log")))[0]
                 for i in range(args.workers)]
        print(f"routing: {args.workers} workers up in {time.time() - t_start:.0f} s (logs in {work})", flush=True)
        for p in ports:  # first-use paths (streaming, these prompt lengths) before anything is measured
            with cf.ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda q: stream_one(p, q, args.max_tokens), warm_prompts))
        for r in range(args.rounds):
            order = args.policies if r % 2 == 0 else args.policies[::-1]
            for policy in order:
                res = run_policy(policy, ports, prompts, args, work, f"{policy}_{r}")
                res["round"], res["load_avg"] = r, os.getloadavg()[0]
                runs.append(res)
                print(f"routing: round {r} {policy}: {json.dumps({k: v for k, v in res.items() if k != 'errors'})}"
                      f"{' errors: ' + str(res['errors'][:3]) if res['errors'] else ''}", flush=True)

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    kv = (f"{args.kv_cache_tokens} tokens ({args.kv_cache_tokens * token_bytes / 2**20:.0f} MiB)" if args.kv_cache_tokens
          else "vLLM's default (VLLM_TPU_KVCACHE_SPACE, 1 GiB)")
    rows = [f"| {x['policy']} | {x['round']} | {' / '.join(map(str, x['requests_per_worker']))} | "
            f"{100 * x['hit_rate']:.1f}% ({' / '.join(f'{100 * h:.0f}%' for h in x['per_worker_hit_rate'])}) | "
            f"{x['ttft_p50_ms']:.0f} | {x['ttft_p99_ms']:.0f} | {x['output_tok_s']:.1f} | {x['wall_s']:.1f} | "
            f"{len(x['errors'])} | {x['load_avg']:.1f} |" for x in runs]
    text = f"""`benchmarks/routing.py`, {datetime.date.today()}, commit {commit}, {platform.machine()} with
{os.cpu_count()} cores, no accelerator (tpu = the CPU PJRT plugin). {args.workers} vLLM servers on tpu
(`python -m torch_tpu.vllm serve`, compiled, `--max-num-seqs {args.max_num_seqs} --max-model-len
{args.max_model_len} --dtype float32`, prefix caching on, KV cache per worker: {kv}) behind
sglang-router 0.3.2. Model: Qwen3-type, 4 layers, width 512, 8 query and 4 kv heads of 64, random
weights, byte-level tokenizer. Workload: {args.requests} streamed completions over {args.system_prompts}
system prompts of {args.system_len} tokens, each with its own user turn (prompts of
{min(prompt_tokens)}-{max(prompt_tokens)} tokens), shuffled (seed {args.seed}), {args.concurrency} in flight,
{args.max_tokens} output tokens each (ignore_eos, greedy). Before each policy: every worker's prefix
cache emptied (POST /reset_prefix_cache) and a new router. Hit rate: prefix-cache hit tokens /
queried tokens over both workers (each worker's in brackets), from vllm:prefix_cache_hits_total
and vllm:prefix_cache_queries_total; the user turns (about 35 of each prompt's tokens) never hit.
Load avg: the machine's 1-minute load average after the run (other work shares its 2 cores).

| policy | round | requests per worker | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s | errors | load avg |
| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(rows) + "\n"
    write_report(text, args.out, work, runs)
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
