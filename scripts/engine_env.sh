# Shared by the set-up scripts of the engines' own environments (setup_vllm.sh, setup_verl.sh),
# sourced from the checkout's root.

# scripts/setup.sh (the main environment and the extension every environment uses), then the
# environment VENV, made with the main environment's interpreter (the extension is built for it).
# Sets ROOT, VENV, PY, LOG (its set-up log) and NAME (the script's name, for messages).
engine_venv() {  # engine_venv VENV NAME
  bash scripts/setup.sh >/dev/null
  ROOT=$(pwd) VENV=$1 NAME=$2
  if [ ! -x "$VENV/bin/python" ]; then
    "$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  fi
  PY="$VENV/bin/python"
  LOG="$VENV/setup.log"
}

# torch_tpu from this checkout, editable; its build is the one setup.sh made (cmake and ninja
# come from the main environment).
install_torch_tpu() {  # install_torch_tpu LOG
  PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pip install -q --no-build-isolation --no-deps -e . >>"$1" 2>&1 ||
    { tail -20 "$1"; echo "$NAME: installing torch_tpu failed (log: $1)"; exit 1; }
}

# After the engine's own packages: PyPI's torchvision (and torchaudio, torchcodec) for this torch
# link CUDA libraries, and with them transformers' imports fail ("operator torchvision::nms does
# not exist"); the text models here need none of them. Then torch_tpu.
finish_engine_env() {
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  install_torch_tpu "$LOG"
}

# An install older than pyproject.toml's entry point in GROUP (one named torch_tpu): again.
ensure_entry_point() {  # ensure_entry_point GROUP
  if ! "$PY" - "$1" 2>/dev/null <<'PYEOF'
import importlib.metadata as m, sys
sys.exit(not any(e.name == "torch_tpu" for e in m.entry_points(group=sys.argv[1])))
PYEOF
  then
    install_torch_tpu "$LOG"
  fi
}
