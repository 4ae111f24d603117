"""vLLM's offline engine (LLM.generate) on tpu through the platform plugin:
greedy tokens equal Hugging Face generate on the CPU for a llama-type and a
qwen-type model, over prompts of different lengths, with chunked prefill
mixed with decode and prefix-cache passes; no op falls back to the CPU
(TORCH_TPU_FALLBACK=error); nothing compiles after the engine's warm-up
for requests of new lengths, one by one or in concurrent groups, nor once a
batch's shapes were seen; compiled, every step replays a recorded program;
seeded sampling repeats."""
import json
import os

import pytest

from conftest import PROMPTS, hf_greedy, run_script

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llm_worker.py")
NEW = 24


def run_llm(model, extra_env=None, *extra_args):
    argv = [WORKER, model, json.dumps(PROMPTS), str(NEW), *(extra_args or ("4",))]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    env = {"TORCH_TPU_FALLBACK": "error", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(extra_env or {})}
    p = run_script(code, env)
    assert p.returncode == 0, p.stderr[-4000:]
    # The last JSON line: worker processes (tensor parallel) may print after it.
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])


# The gate starts the engine once (llama, compiled); the full tier runs the rest.
@pytest.mark.parametrize("kind,eager", [("llama", False), pytest.param("qwen3", False, marks=pytest.mark.slow),
                                        pytest.param("llama", True, marks=pytest.mark.slow)])
def test_greedy_equals_hugging_face(models, kind, eager):
    # Compiled (vLLM's default: the model traced once by Dynamo, compiled by
    # torch_tpu's backend) and op by op (enforce_eager, strict eager).
    path = models[kind]
    ref = hf_greedy(path, PROMPTS, NEW)
    got = run_llm(path, {"LLM_WORKER_EAGER": "1" if eager else "0", "LLM_WORKER_NEW_LENGTHS": "0" if eager else "100",
                         "LLM_WORKER_MIXED": "0" if eager else "100"})
    assert got["platform"] == "tpu"
    assert got["metrics"]["fallbacks"] == {}
    for run in got["greedy"]:  # later passes read the prefix cache
        assert run == ref
    m = got["metrics"]
    if not eager:
        # The engine's warm-up compiled what 100 requests of new prompt
        # lengths need, one after another and then in concurrent groups
        # (prefill and decode mixed in any proportion): nothing compiles.
        assert m["programs_after_new_lengths"] == m["programs_after_warm_up"], m
        assert m["programs_after_groups"] == m["programs_before_groups"], m
        # Every step after the warm-up replayed a program the warm-up recorded.
        warm, steps = m["steps_after_warm_up"], m["steps"]
        assert steps["captures"] == warm["captures"] == steps["shapes"], (warm, steps)
        assert steps["unrecorded"] == warm["unrecorded"] and steps["replays"] - warm["replays"] > 200, (warm, steps)
    else:
        assert m["steps"] is None  # --enforce-eager runs op by op
    # Warmed up: passes 3 and 4 repeat pass 2's shapes and compile nothing
    # (pass 1 prefilled whole prompts, pass 2 only what the cache lacked).
    programs = got["metrics"]["programs_after_pass"]
    assert programs[3] == programs[1], programs
    # Seeded sampling repeats; top-k 1 is greedy.
    assert got["sampled"][0] == got["sampled"][1]
    assert got["top_k1"] == [r[:NEW] for r in ref[:2]]


@pytest.mark.slow
def test_cpu_platform_still_chosen_when_asked(models):
    # VLLM_TARGET_DEVICE=cpu keeps vLLM's own CPU backend: the plugin does not
    # take over an install that asks for the CPU.
    # Its default (92% of the machine's memory free at start) failed with other jobs running.
    got = run_llm(models["llama"], {"VLLM_TARGET_DEVICE": "cpu", "TORCH_TPU_FALLBACK": "warn", "LLM_WORKER_EAGER": "1",
                                    "LLM_WORKER_MEMORY_FRACTION": "0.3"}, "1", "greedy")
    assert got["platform"] == "cpu"
    assert got["greedy"][0] == hf_greedy(models["llama"], PROMPTS, NEW)


@pytest.mark.slow
def test_a_full_kv_cache_preempts_and_loses_nothing(models):
    # 17 blocks of 16 tokens: one 256-token context and vLLM's null block. Four sequences
    # growing past 80 tokens each do not fit at once: vLLM preempts and
    # recomputes, and every request still gets its greedy tokens.
    path = models["llama"]
    n = 80
    ref = hf_greedy(path, PROMPTS, n)
    argv = [WORKER, path, json.dumps(PROMPTS), str(n), "1", "greedy"]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    kv_bytes = 17 * 2 * 2 * 16 * 2 * 64 * 4  # blocks (one is vLLM's null block) x layers x kv heads x block x (k, v) x head x float32
    p = run_script(code, {"TORCH_TPU_FALLBACK": "error", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                          "VLLM_TPU_KVCACHE_SPACE": str(kv_bytes / 2**30), "LLM_WORKER_EAGER": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # The cache holds less than four running sequences need at their longest.
    assert got["kv_blocks"] * 16 < 4 * (n + 1), got["kv_blocks"]
    assert got["greedy"][0] == ref


@pytest.mark.slow
def test_tensor_parallel_2_gives_the_same_greedy_tokens(models):
    # Two worker processes, tpu:0 and tpu:1 (two CPU devices per process),
    # the model's linear layers split across them, all-reduces over tpu_dist
    # (the platform's dist_backend). Compiled: Dynamo's graph with vLLM's
    # collective ops, each step recorded and replayed.
    got = run_llm(models["qwen3"], {"LLM_WORKER_TP": "2", "TORCH_TPU_CPU_DEVICES": "2"}, "1", "greedy")
    assert got["platform"] == "tpu"
    assert got["greedy"][0] == hf_greedy(models["qwen3"], PROMPTS, NEW)
