"""Serving benchmark: SGLang's own `bench_serving` against SGLang's OpenAI
server on tpu (torch_tpu/sglang) and against vLLM's on tpu (torch_tpu/vllm),
in one run, on the same model and requests (random token ids, OpenAI
/v1/completions on both). Prints a Markdown table (output tokens/s, time to
first token and inter-token latency p50/p99).

Run in the SGLang environment (scripts/setup_sglang.sh), with the vLLM
environment made too (scripts/setup_vllm.sh):
    .venv-sglang/bin/python benchmarks/sglang_serving.py [--num-prompts 32] [--max-concurrency 16]

Also the SGLang server helper of tests/sglang (`sglang_server`).
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from vllm_models import make_model  # noqa: E402
from vllm_server import _tail, free_port, stop  # noqa: E402


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def server_process(cmd: list[str], port: int, env: dict, log_path: str, start_timeout: float = 600):
    """Runs cmd (a server on port) in its own process group; yields the
    process once GET /health answers 200. RuntimeError with the end of its
    log if it exits or does not answer in time. Stopped on exit."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.time()
        while not _answers(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[2]} exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.time() - started > start_timeout:
                raise RuntimeError(f"{cmd[2]} did not answer in {start_timeout:.0f} s:\n{_tail(log_path)}")
            time.sleep(1)
        yield proc
    finally:
        stop(proc)


@contextmanager
def sglang_server(model: str, args: list[str], env: dict, log_path: str, start_timeout: float = 600,
                  python: str = sys.executable):
    """SGLang's OpenAI server (`python -m sglang.launch_server`) on a free
    local port; yields (port, process)."""
    port = free_port()
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
           *args]
    with server_process(cmd, port, env, log_path, start_timeout) as proc:
        yield port, proc


def vllm_server(model: str, args: list[str], env: dict, log_path: str, python: str):
    """vLLM's OpenAI server with torch_tpu's platform (`python -m torch_tpu.vllm serve`)."""
    port = free_port()
    cmd = [python, "-m", "torch_tpu.vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]

    @contextmanager
    def run():
        with server_process(cmd, port, env, log_path) as proc:
            yield port, proc

    return run()


def bench(backend: str, port: int, model: str, out: str, args, num_prompts: int, seed: int) -> dict:
    """One run of SGLang's bench_serving; its result (the JSON line it appends to out)."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url",
           f"http://127.0.0.1:{port}", "--model", "bench", "--tokenizer", model, "--dataset-name", "random-ids",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1", "--num-prompts", str(num_prompts), "--max-concurrency",
           str(args.max_concurrency), "--request-rate", "inf", "--seed", str(seed), "--output-file", out,
           "--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    # Whole-number options: the workload of benchmarks/serving.py.
    for name, default in (("num-prompts", 32), ("input-len", 128), ("output-len", 64), ("max-concurrency", 16),
                          ("max-model-len", 512), ("rounds", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--engines", default="sglang,vllm", help="comma-separated: sglang, vllm")
    ap.add_argument("--sglang-args", default="", help="more launch_server arguments, e.g. '--chunked-prefill-size 512'")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="sglang_bench_")
    # The model of benchmarks/serving.py: Qwen3-type, 4 layers, width 512, 8 heads of 64 (2 per kv head).
    model = make_model(os.path.join(work, "model"), "qwen3", layers=4, width=512, heads=8, kv_heads=4,
                       max_len=args.max_model_len)
    env = dict(os.environ, TORCH_TPU_FALLBACK="error")
    engines = {
        "sglang": ("sglang-oai", lambda log: sglang_server(
            model, ["--served-model-name", "bench", "--dtype", "float32", "--context-length", str(args.max_model_len),
                    "--max-running-requests", str(args.max_concurrency), "--max-total-tokens", "32768",
                    *args.sglang_args.split()],
            env, log)),
        "vllm": ("vllm", lambda log: vllm_server(
            model, ["--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
                    "--max-num-seqs", str(args.max_concurrency)],
            dict(env, VLLM_TORCH_TPU="1", VLLM_TPU_KVCACHE_SPACE="1"), log, args.vllm_python)),
    }
    results = {}
    for name in args.engines.split(","):
        backend, start = engines[name]
        with start(os.path.join(work, f"{name}.log")) as (port, _):
            out = os.path.join(work, f"{name}.jsonl")
            bench(backend, port, model, out, args, max(4, args.max_concurrency), seed=99)  # warm-up
            results[name] = [bench(backend, port, model, out, args, args.num_prompts, seed=r)
                             for r in range(args.rounds)]

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows = [f"| {name} on tpu | {r} | {res['output_throughput']:.1f} | {res['median_ttft_ms']:.0f} | "
            f"{res['p99_ttft_ms']:.0f} | {res['median_itl_ms']:.1f} | {res['p99_itl_ms']:.1f} |"
            for name, runs in results.items() for r, res in enumerate(runs)]
    text = f"""`benchmarks/sglang_serving.py`, {datetime.date.today()}, commit {commit}, {platform.machine()} with
{os.cpu_count()} cores, no accelerator (tpu = the CPU PJRT plugin). SGLang's `bench_serving`
(random token ids: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens
each, max concurrency {args.max_concurrency}, OpenAI /v1/completions) after one warm-up run;
model: Qwen3-type, 4 layers, width 512, 8 query heads and 4 kv heads of 64, float32, random weights.
SGLang: `--max-running-requests {args.max_concurrency} --max-total-tokens 32768 {args.sglang_args}`; vLLM:
`--max-num-seqs {args.max_concurrency}`, a KV cache of 1 GiB.

| engine | round | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(rows) + "\n"
    print(text)
    print(f"raw results and server logs: {work}")


if __name__ == "__main__":
    main()
