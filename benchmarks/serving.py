"""Serving benchmark: vLLM's own `vllm bench serve` against vLLM's OpenAI
server on tpu (this plugin, CPU PJRT plugin underneath) and on vLLM's own CPU
backend, side by side in one run, on the same model and requests. Writes a
Markdown table (output tokens/s, time to first token, inter-token latency
p50/p99) and the raw results.

Run in the serving environment (scripts/setup_vllm.sh):
    .venv-vllm/bin/python benchmarks/serving.py [--num-prompts 32] [--out docs/serving_benchmark.md]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from vllm_models import make_model  # noqa: E402
from sglang_serving import sglang_server  # noqa: E402
from vllm_server import serving, write_report  # noqa: E402


def bench(model, port, result_dir, name, args, num_prompts, seed, dataset=None, backend="vllm"):
    """vLLM's `vllm bench serve` against the server; `dataset`: its dataset
    arguments (default: random prompts of --input-len, --output-len out)."""
    dataset = dataset or ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                          "--random-output-len", str(args.output_len)]
    cmd = [sys.executable, "-m", "torch_tpu.vllm", "bench", "serve", "--backend", backend, "--base-url",
           f"http://127.0.0.1:{port}", "--model", "bench", "--tokenizer", model, *dataset, "--num-prompts",
           str(num_prompts), "--request-rate", str(args.request_rate), "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result", "--result-dir",
           result_dir, "--result-filename", f"{name}.json", "--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(os.path.join(result_dir, f"{name}.json")) as f:
        return json.load(f)


# Prefix caching: prompts of 448 tokens, 320 of them a prefix shared by all of one
# group (2 groups), against 448 random tokens each; 16 tokens out.
PREFIX_LEN, SUFFIX_LEN, PREFIX_OUT = 320, 128, 16
SHARED = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX_LEN),
          "--prefix-repetition-suffix-len", str(SUFFIX_LEN), "--prefix-repetition-num-prefixes", "2",
          "--prefix-repetition-output-len", str(PREFIX_OUT)]
UNSHARED = ["--dataset-name", "random", "--random-input-len", str(PREFIX_LEN + SUFFIX_LEN),
            "--random-output-len", str(PREFIX_OUT)]


def step_stats(port):
    """The tpu worker's step statistics (TpuWorker.step_stats, through vLLM's
    dev-mode /collective_rpc): work computed and padded, programs made."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/collective_rpc", method="POST",
                                 data=json.dumps({"method": "step_stats"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["results"][0]


def delta(before, after):
    """Padding fractions of the steps between two step_stats."""
    d = {k: after[k] - before[k] for k in ("tokens", "computed_tokens", "attention_pairs",
                                           "computed_attention_pairs", "decode_attention_pairs",
                                           "computed_decode_attention_pairs", "programs", "steps")}
    d["matmul_padding"] = 1 - d["tokens"] / max(1, d["computed_tokens"])
    d["attention_padding"] = 1 - d["attention_pairs"] / max(1, d["computed_attention_pairs"])
    d["decode_padding"] = 1 - d["decode_attention_pairs"] / max(1, d["computed_decode_attention_pairs"])
    d["prefill_padding"] = 1 - ((d["attention_pairs"] - d["decode_attention_pairs"])
                                / max(1, d["computed_attention_pairs"] - d["computed_decode_attention_pairs"]))
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager: op by op (default: compiled)")
    ap.add_argument("--backends", default="tpu,sglang,cpu",
                    help="comma-separated: tpu (vLLM on tpu), sglang (SGLang on tpu), cpu (vLLM's CPU backend)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "serving_benchmark.md"))
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="serving_bench_")
    # Tiny but not a toy: 4 layers, width 512, 8 heads of 64 (2 per kv head).
    model = make_model(os.path.join(work, "model"), "qwen3", layers=4, width=512, heads=8, kv_heads=4,
                       max_len=args.max_model_len)
    # The same KV cache size on both (GiB). Unset, vLLM's CPU backend sizes
    # its cache from free memory: 21 GB of this 24 GB machine, and it thrashed.
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"
    backends = {
        # Dev mode: /collective_rpc reads the worker's step statistics.
        "tpu": dict(os.environ, VLLM_TORCH_TPU="1", VLLM_TPU_KVCACHE_SPACE=kv, VLLM_SERVER_DEV_MODE="1"),
        "sglang": dict(os.environ),
        "cpu": dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_TORCH_TPU="0", VLLM_CPU_KVCACHE_SPACE=kv),
    }
    # SGLang (its own environment, scripts/setup_sglang.sh): the same limits, a KV pool of the
    # same size (8 KiB a token for this model), prefill chunks of 512 tokens.
    sglang_args = ["--served-model-name", "bench", "--dtype", "float32", "--context-length", str(args.max_model_len),
                   "--max-running-requests", str(args.max_num_seqs), "--max-total-tokens",
                   str(int(float(kv) * 2**30) // 8192), "--chunked-prefill-size", "512"]
    backends = {name: backends[name] for name in args.backends.split(",")}
    results = {name: [] for name in backends}
    steps = {name: [] for name in backends}
    prefix = {name: {} for name in backends}
    server_args = ["--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
                   "--max-num-seqs", str(args.max_num_seqs)] + (["--enforce-eager"] if args.eager else [])
    for name, env in backends.items():
        log = os.path.join(work, f"{name}.log")
        client = "openai" if name == "sglang" else "vllm"  # SGLang's /v1/completions
        server = (sglang_server(model, sglang_args, env, log, python=os.path.join(ROOT, ".venv-sglang", "bin", "python"))
                  if name == "sglang" else serving(model, server_args, env, log))
        with server as (port, _):
            bench(model, port, work, f"{name}_warmup", args, max(4, args.max_num_seqs), seed=99, backend=client)
            for r in range(args.rounds):
                before = step_stats(port) if name == "tpu" else None
                results[name].append(bench(model, port, work, f"{name}_{r}", args, args.num_prompts, seed=r,
                                           backend=client))
                if before is not None:
                    steps[name].append(delta(before, step_stats(port)))
            for kind, dataset in (("unshared", UNSHARED), ("shared", SHARED)):
                prefix[name][kind] = bench(model, port, work, f"{name}_{kind}", args, args.num_prompts, seed=7,
                                           dataset=dataset, backend=client)

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows, pad_rows = [], []
    for name, runs in results.items():
        for r, res in enumerate(runs):
            rows.append(
                f"| {name} | {r} | {res['output_throughput']:.1f} | {res['median_ttft_ms']:.0f} | "
                f"{res['p99_ttft_ms']:.0f} | {res['median_itl_ms']:.1f} | {res['p99_itl_ms']:.1f} | "
                f"{res['p99_itl_ms'] / res['median_itl_ms']:.2f} |")
        for r, st in enumerate(steps[name]):
            pad_rows.append(f"| {name} | {r} | {st['steps']} | {st['matmul_padding']:.1%} | "
                            f"{st['attention_padding']:.1%} | {st['decode_padding']:.1%} | "
                            f"{st['prefill_padding']:.1%} | {st['programs']} |")
    prefix_rows = [f"| {name} | {res['unshared']['median_ttft_ms']:.0f} | {res['shared']['median_ttft_ms']:.0f} | "
                   f"{res['unshared']['median_ttft_ms'] / res['shared']['median_ttft_ms']:.2f}x |"
                   for name, res in prefix.items()]
    ratios = [t["output_throughput"] / c["output_throughput"]
              for t, c in zip(results.get("tpu", []), results.get("cpu", []))]
    text = f"""# Serving benchmark: vLLM and SGLang on tpu against vLLM's CPU backend

`benchmarks/serving.py`, {datetime.date.today()}, commit {commit}, {platform.machine()} with
{os.cpu_count()} cores, no accelerator (tpu = the CPU PJRT plugin). vLLM's `vllm bench serve`
(random dataset: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output
tokens each, ignore_eos, request rate {args.request_rate}, the same client for every server) against:
tpu, `python -m torch_tpu.vllm serve --max-num-seqs {args.max_num_seqs}{" --enforce-eager" if args.eager else ""}
--dtype float32` (compiled: torch_tpu's backend, steps replayed); sglang, SGLang 0.5.21's
`launch_server` on tpu (torch_tpu/sglang; `--max-running-requests {args.max_num_seqs} --chunked-prefill-size
512`, its OpenAI completions); cpu, vLLM's own CPU backend (Inductor). Model: Qwen3-type, 4 layers,
width 512, 8 query heads and 4 kv heads of 64, random weights; a KV cache of {kv} GiB on each. Each
server warmed up with one run first ({max(4, args.max_num_seqs)} prompts); then its rounds.

| backend | round | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99/p50 |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(rows) + f"""

tpu / cpu output throughput per round: {", ".join(f"{x:.2f}x" for x in ratios)}.

Work of the tpu server's steps in each round (`TpuWorker.step_stats`): the fraction of matmul rows
that were padding tokens (a step runs its token bucket), of attention query-key pairs that were
padding rows or keys past a sequence's end (paged_attention reads whole key tiles), and the
programs made (compiled or read from the disk cache) during the round, after the warm-up run.

| backend | round | steps | matmul padding | attention padding | of decode loops | of prefill tiles | programs made |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(pad_rows) + f"""

Prefix caching (on in both servers, vLLM's default): time to first token, {args.num_prompts} prompts
of {PREFIX_LEN + SUFFIX_LEN} tokens, {PREFIX_OUT} out; shared: the first {PREFIX_LEN} tokens are one of
2 prefixes (vLLM's `prefix_repetition` dataset); unshared: random prompts.

| backend | TTFT p50 ms, unshared | TTFT p50 ms, shared | unshared / shared |
| --- | ---: | ---: | ---: |
""" + "\n".join(prefix_rows) + "\n"
    write_report(text, args.out, work, {"results": results, "steps": steps, "prefix": prefix})


if __name__ == "__main__":
    main()
