"""Tiny models, made offline (no hub), for the vLLM platform's tests: a
llama-type and a qwen-type (Qwen3: per-head q/k norms, grouped-query heads)
causal LM, head size 64 (vLLM's CPU attention refuses 16), float32 weights,
a byte-level BPE tokenizer with a chat template."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from vllm_models import make_model  # noqa: E402

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "vllm serves models on many devices including tpu and cpu and more of them every day",
    "paged attention stores keys and values in blocks of sixteen tokens each one",
    "tiny",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {kind: make_model(str(root / kind), kind) for kind in ("llama", "qwen3")}


def hf_greedy(path, prompts, n):
    """Greedy continuations by the Hugging Face model on the CPU: n argmax
    steps, end-of-sequence included (vLLM's ignore_eos). Not generate():
    its min_new_tokens would forbid the end token instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            new = []
            for _ in range(n):
                nxt = model(ids).logits[0, -1].argmax().item()
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            out.append(new)
    return out


def run_script(code: str, env_extra: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (vLLM's engine owns process-wide state)."""
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
