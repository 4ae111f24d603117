"""Every sampling parameter vLLM accepts, on tpu (torch_tpu/vllm/sampler.py):
nothing compiles after the engine's warm-up for any mix of them, no op falls
back to the CPU, seeded sampling repeats, and tokens and logprobs equal vLLM's
own CPU backend where no random stream is involved."""
import json
import os

import pytest
import torch

from conftest import run_script

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sampling_worker.py")


def run_worker(model, env):
    code = f"import runpy, sys; sys.argv = {[WORKER, model]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    p = run_script(code, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tpu_run(models):
    return run_worker(models["qwen3"], {"TORCH_TPU_FALLBACK": "error"})


def test_no_program_compiles_after_warm_up_for_any_sampling_mix(tpu_run):
    assert tpu_run["platform"] == "tpu"
    m = tpu_run["metrics"]
    assert m["fallbacks"] == {}
    # Compiled or read from the disk cache: any program not made during the warm-up.
    assert m["programs_at_end"] == m["programs_after_warm_up"], m


def test_seeded_sampling_repeats(tpu_run):
    first, second = tpu_run["seeded"]
    assert first == second
    assert len({tuple(t) for t in first}) == len(first)  # and the seeds differ


@pytest.mark.slow
def test_tokens_and_logprobs_equal_vllm_cpu_backend(models, tpu_run):
    cpu = run_worker(models["qwen3"], {"VLLM_TARGET_DEVICE": "cpu", "SAMPLING_WORKER_EAGER": "1",
                                       "SAMPLING_WORKER_MIX": "0", "SAMPLING_WORKER_MEMORY_FRACTION": "0.3"})
    assert cpu["platform"] == "cpu"
    assert len(cpu["deterministic"]) == len(tpu_run["deterministic"])
    for i, (t, c) in enumerate(zip(tpu_run["deterministic"], cpu["deterministic"])):
        assert t["tokens"] == c["tokens"], i
        assert t["text"] == c["text"], i
        for key in ("logprobs", "prompt_logprobs"):
            assert len(t[key]) == len(c[key]), (i, key)
            for step_t, step_c in zip(t[key], c[key]):
                if step_c is None:
                    assert step_t is None
                    continue
                assert step_t.keys() == step_c.keys(), (i, key)
                torch.testing.assert_close(torch.tensor([step_t[k] for k in step_c]),
                                           torch.tensor(list(step_c.values())), msg=f"request {i} {key}")
