"""SGLang on tpu (torch_tpu/sglang), in the SGLang environment
(scripts/setup_sglang.sh): tiny models made offline (benchmarks/vllm_models.py:
llama-type and Qwen3-type, head size 64, float32 weights, a byte-level BPE
tokenizer with a chat template) and Hugging Face's greedy tokens on the CPU,
both as the vLLM tests have them (tests/vllm/conftest.py)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Every run on tpu with TORCH_TPU_FALLBACK=error: an op that would run on the
# CPU instead raises (here, and in the engines and servers the tests start).
TPU_ENV = {"TORCH_TPU_FALLBACK": "error"}
os.environ.update(TPU_ENV)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from vllm_models import make_model  # noqa: E402


def _vllm_tests(name: str):
    """tests/vllm/NAME.py as a module, for its helpers (they import no vLLM)."""
    spec = importlib.util.spec_from_file_location(f"vllm_tests_{name}", os.path.join(ROOT, "tests", "vllm", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _vllm_tests("conftest")
PROMPTS = _shared.PROMPTS
hf_greedy = _shared.hf_greedy



# Engine and server settings of the tests: a small KV pool and context.
ENGINE_ARGS = {"dtype": "float32", "context_length": 256, "max_total_tokens": 8192, "max_running_requests": 8}


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_models")
    return {kind: make_model(str(root / kind), kind) for kind in ("llama", "qwen3")}


def run_engine(script: str, args: list[str], timeout: int = 600) -> tuple[dict, str]:
    """Runs the Python file `script` with `args` in a fresh interpreter on tpu
    (SGLang's Engine starts processes of its own); the script prints its
    result as one JSON line prefixed RESULT. Returns (result, its stderr)."""
    env = dict(os.environ, **TPU_ENV)
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), proc.stderr
    raise AssertionError(f"the engine script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
