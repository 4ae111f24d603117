#!/usr/bin/env bash
# Reinforcement-learning set-up (idempotent): a third environment, .venv-verl, with VeRL
# 0.9.1 and torch_tpu installed from this checkout (its VeRL plugin, torch_tpu/verl, found
# through the entry-point group verl.plugins). An environment of its own because VeRL caps
# transformers below 5.11 and tensordict at 0.10, older than the main environment's.
# VeRL's base package, no extras: every extra pins torch 2.11. Runs scripts/setup.sh first
# (it builds the extension every environment uses).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/engine_env.sh
engine_venv "$(pwd)/.venv-verl" setup_verl
# What VeRL's trainer imports beyond its declared dependencies: cachetools (its rollout
# router), uvicorn and fastapi (its rollout server utilities).
if ! "$PY" -c "import verl, ray.train, tensordict, cachetools, uvicorn, fastapi, pytest, torch_tpu.verl" 2>/dev/null; then
  # torch named with its version so that pip cannot pick another build.
  "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "verl==0.9.1" "transformers<5.11" \
    "tensordict<=0.10" "ray[train]==2.60.0" cachetools uvicorn fastapi numpy pytest >"$LOG" 2>&1 ||
    { grep -v "is ignored: it is neither" "$LOG" | tail -20; echo "setup_verl: installing verl failed (log: $LOG)"; exit 1; }
  "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' ||
    { echo "setup_verl: pip replaced torch 2.13.0 with $("$PY" -c 'import torch; print(torch.__version__)') (log: $LOG)"; exit 1; }
  finish_engine_env
fi
ensure_entry_point verl.plugins
echo "setup_verl: done ($("$PY" -c 'import verl, torch; print("verl", verl.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
