#!/usr/bin/env bash
# Routing set-up (idempotent): the serving environment (scripts/setup_vllm.sh, .venv-vllm) plus
# sglang-router 0.3.2, SGLang's Rust router (cache-aware, round-robin and load-aware policies
# over OpenAI-compatible HTTP workers; no torch dependency), for scripts/serve_routed.py,
# benchmarks/routing.py and tests/vllm/test_routing.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
PY="${TORCH_TPU_VLLM_VENV:-$(pwd)/.venv-vllm}/bin/python"
if ! "$PY" -c "import sglang_router" 2>/dev/null; then
  LOG="$(dirname "$(dirname "$PY")")/setup_routing.log"
  "$PY" -m pip install -q "sglang-router==0.3.2" >"$LOG" 2>&1 ||
    { tail -20 "$LOG"; echo "setup_routing: installing sglang-router failed (log: $LOG)"; exit 1; }
fi
echo "setup_routing: done ($("$PY" -c 'import importlib.metadata as m; print("sglang-router", m.version("sglang-router"))'))"
