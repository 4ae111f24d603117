"""SGLang's offline Engine on tpu gives Hugging Face's greedy tokens (CPU,
argmax loop) for a llama-type and a Qwen3-type model, with
TORCH_TPU_FALLBACK=error; decode steps run as replayed programs (SGLang logs
its decode batches with "cuda graph: True" when its graph runner ran them);
the radix (prefix) cache serves a second request's shared prefix."""
import json
import os

import pytest

from conftest import ENGINE_ARGS, PROMPTS, hf_greedy, run_engine

pytest.importorskip("sglang", reason="SGLang's environment: scripts/setup_sglang.sh")

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = 16
# Long enough that the shared part spans many tokens of the tiny tokenizer.
PREFIX = "the lazy dog jumps over the quick brown fox " * 4 + "hello world this is a tiny model for testing"


def run(model: str, prefix: str | None):
    spec = {"engine": ENGINE_ARGS, "prompts": PROMPTS, "new": NEW, "prefix": prefix}
    return run_engine(os.path.join(HERE, "engine_worker.py"), [model, json.dumps(spec)])


def check_batch(model: str, result: dict, log: str) -> None:
    assert result["batch"] == hf_greedy(model, PROMPTS, NEW)
    # Decode steps went through torch_tpu's graph runner (recorded and replayed).
    assert "torch_tpu: recorded decode steps" in log
    assert "cuda graph: True" in log, log[-3000:]


@pytest.mark.slow
def test_engine_llama_equals_hugging_face_and_radix_cache(models):
    model = models["llama"]
    result, log = run(model, PREFIX)
    check_batch(model, result, log)
    (first, cached_first), (second, cached_second), (again, cached_again) = result["prefix"]
    ref_one, ref_two = hf_greedy(model, [PREFIX + " one", PREFIX + " two"], NEW)
    # The second request shares the long prefix: it comes from the radix cache (the first one
    # may share a few tokens with the batch's prompts), with the tokens computed without it.
    assert cached_second >= 60 and cached_second > cached_first + 20, (cached_first, cached_second)
    assert second == ref_two
    assert first == ref_one and again == ref_one
    assert cached_again > cached_second


@pytest.mark.slow
def test_engine_qwen3_equals_hugging_face(models):
    model = models["qwen3"]
    result, log = run(model, None)
    check_batch(model, result, log)
