"""VeRL on tpu: the tests run in .venv-verl (scripts/setup_verl.sh), like tests/vllm in
.venv-vllm. The tiny model, its tokenizer, the toy task and its reward are
benchmarks/verl_grpo.py's, made offline in a temporary folder."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("verl", reason="VeRL is not installed: run the tests in .venv-verl (scripts/setup_verl.sh)")

import verl_grpo  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return verl_grpo.make_model(str(tmp_path_factory.mktemp("verl_model")))

