#!/usr/bin/env bash
# SGLang serving set-up (idempotent): an environment of its own, .venv-sglang, with SGLang
# 0.5.21 (the SGLang that pins our torch 2.13.0) and torch_tpu installed from this checkout
# (its SGLang platform plugin, torch_tpu/sglang, found through the entry-point group
# sglang.srt.platforms). Its own environment because SGLang pins transformers 5.12.1, older
# than the main environment's and vLLM's.
# SGLang with --no-deps: its dependency list names CUDA-only packages (sglang-kernel,
# flashinfer, cuda-python, ...). Installed instead: the packages SGLang imports when it serves
# text models (found by importing its engine, server, scheduler, model runner, models and
# bench_serving), pinned where SGLang pins them; triton (sglang.srt.utils imports it, it has
# no driver here and runs nothing); SGLang's Rust router (sglang-router); and, since PyPI's
# torchvision for torch 2.13 links CUDA, torch_tpu's torchvision stand-in
# (torch_tpu/sglang/_torchvision.py: the names SGLang and transformers import, no image ops).
# Runs scripts/setup.sh first (it builds the extension every environment uses).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/engine_env.sh
engine_venv "$(pwd)/.venv-sglang" setup_sglang

SGLANG_DEPS=(
  "transformers==5.12.1" "tokenizers==0.22.2" "openai==2.6.1" "compressed-tensors==0.18.0" "xgrammar==0.2.7"
  "openai-harmony==0.0.4" "sentencepiece==0.2.1" "soundfile==0.13.1" "triton==3.9.0" aiohttp fastapi uvicorn uvloop orjson pyzmq psutil
  pydantic python-multipart requests msgspec setproctitle pybase64 "prometheus-client>=0.20.0" partial_json_parser
  pillow interegular einops xxhash tiktoken numpy packaging tqdm distro easydict zstandard watchfiles IPython dill
  gguf jsonschema datasets
)

# torch_tpu's torchvision stand-in, as an installed distribution "torchvision" (with a RECORD,
# so that pip can remove it).
install_torchvision_standin() {
  local site version=0.28.0
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local info="$site/torchvision-$version.dist-info"
  rm -rf "$site/torchvision" "$site"/torchvision-*.dist-info
  mkdir -p "$site/torchvision" "$info"
  cp torch_tpu/sglang/_torchvision.py "$site/torchvision/__init__.py"
  printf 'Metadata-Version: 2.1\nName: torchvision\nVersion: %s\nSummary: torch_tpu stand-in for torchvision (names only, no image operations)\n' \
    "$version" >"$info/METADATA"
  echo torch_tpu >"$info/INSTALLER"
  printf 'torchvision/__init__.py,,\ntorchvision-%s.dist-info/METADATA,,\ntorchvision-%s.dist-info/INSTALLER,,\ntorchvision-%s.dist-info/RECORD,,\n' \
    "$version" "$version" "$version" >"$info/RECORD"
}

if ! "$PY" -c "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server, sglang_router, pytest, torch_tpu.sglang.platform" 2>/dev/null; then
  # torch named with its version so that pip cannot pick another build.
  { "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "sglang==0.5.21" --no-deps &&
    "$PY" -m pip install -q "torch==2.13.0" "xla-cpu-pjrt==0.0.1" "${SGLANG_DEPS[@]}" "sglang-router==0.3.2" pytest; } >"$LOG" 2>&1 ||
    { grep -v "is ignored: it is neither" "$LOG" | tail -20; echo "setup_sglang: installing sglang failed (log: $LOG)"; exit 1; }
  "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' ||
    { echo "setup_sglang: pip replaced torch 2.13.0 with $("$PY" -c 'import torch; print(torch.__version__)') (log: $LOG)"; exit 1; }
  finish_engine_env
  install_torchvision_standin
  "$PY" -c "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server, torch_tpu.sglang.platform" >>"$LOG" 2>&1 ||
    { tail -20 "$LOG"; echo "setup_sglang: sglang does not import (log: $LOG)"; exit 1; }
fi
ensure_entry_point sglang.srt.platforms
echo "setup_sglang: done ($("$PY" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
