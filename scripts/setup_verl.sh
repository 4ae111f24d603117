#!/usr/bin/env bash
# Reinforcement-learning set-up (idempotent): a third environment, .venv-verl, with VeRL
# 0.9.1 and torch_tpu installed from this checkout (its VeRL plugin, torch_tpu/verl, found
# through the entry-point group verl.plugins). An environment of its own because VeRL caps
# transformers below 5.11 and tensordict at 0.10, older than the main environment's.
# VeRL's base package, no extras: every extra pins torch 2.11. Runs scripts/setup.sh first
# (it builds the extension every environment uses).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup.sh >/dev/null
VENV=$ROOT/.venv-verl
if [ ! -x "$VENV/bin/python" ]; then
  # The main environment's interpreter: the extension is built for it.
  "$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# What VeRL's trainer imports beyond its declared dependencies: cachetools (its rollout
# router), uvicorn and fastapi (its rollout server utilities).
if ! "$PY" -c "import verl, ray.train, tensordict, cachetools, uvicorn, fastapi, pytest, torch_tpu.verl" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  LOG="$VENV/setup.log"
  # torch named with its version so that pip cannot pick another build.
  "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "verl==0.9.1" "transformers<5.11" \
    "tensordict<=0.10" "ray[train]==2.60.0" cachetools uvicorn fastapi numpy pytest >"$LOG" 2>&1 ||
    { grep -v "is ignored: it is neither" "$LOG" | tail -20; echo "setup_verl: installing verl failed (log: $LOG)"; exit 1; }
  "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' ||
    { echo "setup_verl: pip replaced torch 2.13.0 with $("$PY" -c 'import torch; print(torch.__version__)') (log: $LOG)"; exit 1; }
  # PyPI's torchvision for this torch links CUDA libraries: with it, transformers' imports
  # fail ("operator torchvision::nms does not exist"). The text models here need none of them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # torch_tpu from this checkout, editable; its build is the one setup.sh made
  # (cmake and ninja come from the main environment).
  PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pip install -q --no-build-isolation --no-deps -e . >>"$LOG" 2>&1 ||
    { tail -20 "$LOG"; echo "setup_verl: installing torch_tpu failed (log: $LOG)"; exit 1; }
fi
# An install older than pyproject.toml's verl.plugins entry point: again.
if ! "$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.name == "torch_tpu" for e in m.entry_points(group="verl.plugins")))' 2>/dev/null; then
  PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 ||
    { echo "setup_verl: installing torch_tpu again failed"; exit 1; }
fi
echo "setup_verl: done ($("$PY" -c 'import verl, torch; print("verl", verl.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
