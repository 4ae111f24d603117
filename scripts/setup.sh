#!/usr/bin/env bash
# One-time (and idempotent) set-up on a fresh machine: system packages,
# a virtual environment with torch 2.13.0 and the PJRT CPU plugin, and the
# C++ extension built with CMake + Ninja and installed (editable) as torch_tpu.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${TORCH_TPU_VENV:-$ROOT/.venv}

# GoogleTest for the C++ units, ccache for fast rebuilds (both optional).
if ! [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && ! [ -f /usr/lib/aarch64-linux-gnu/libgtest.a ] || ! command -v ccache >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgtest-dev ccache >/dev/null 2>&1 ||
     (apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgtest-dev ccache >/dev/null 2>&1)) ||
      echo "setup: could not install libgtest-dev/ccache; C++ unit tests will be skipped"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, xla_plugins.xla_cpu_pjrt, pytest, xdist, ninja, cmake, setuptools, expecttest" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # expecttest: PyTorch's OpInfo database (the op-coverage sweep) imports it.
  # pytest-xdist: scripts/test.sh runs the suite in two worker processes.
  "$PY" -m pip install -q "torch==2.13.0" numpy pytest pytest-xdist expecttest ninja "cmake>=3.24" "setuptools>=64" \
    wheel "xla-cpu-pjrt==0.0.1"
fi
export PATH="$VENV/bin:$PATH"

# The extension builds (the CPU's work) while the packages below download (the network's).
# Configure once, then build incrementally.
build_ext() {
  if [ ! -f build/build.ninja ]; then
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" >/dev/null
  fi
  cmake --build build
}
mkdir -p build
build_log=build/setup-build.log
build_ext >"$build_log" 2>&1 &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null || true' EXIT

# Hugging Face (transformers, and accelerate for device_map and the Trainer) for the
# Hugging Face and compile tests; torch stays pinned so pip cannot swap it for another build.
if ! "$PY" -c "import transformers, accelerate" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" "transformers>=5.17,<6" "accelerate>=1.15,<2" >/dev/null 2>&1 ||
    echo "setup: could not install transformers/accelerate; the Hugging Face tests will be skipped"
fi
# TorchTitan for its distributed training test. It does not pin torch; it imports triton at
# module level (its GPU kernels), so triton comes too, unused here. transformers is named
# again so that the resolver keeps it working: alone, torchtitan (datasets<4.8) got datasets
# 4.7.0, which pins huggingface-hub<2 and broke transformers 5.25 (hub>=2.4); named together,
# pip picks datasets 4.1.1 and hub 2.4.
if ! "$PY" -c "import torchtitan, triton" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" "transformers>=5.17,<6" "accelerate>=1.15,<2" "torchtitan==0.3.0" \
    "triton==3.9.0" >/dev/null 2>&1 ||
    echo "setup: could not install torchtitan; the TorchTitan test will be skipped"
fi
# torch-tpu bench draws with matplotlib and reads YAML sweeps with PyYAML; sarif-pydantic is the
# SARIF 2.1.0 object model the doctor's SARIF output is validated with in the tests.
if ! "$PY" -c "import matplotlib, yaml, tqdm, sarif_pydantic" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" "matplotlib>=3.8" pyyaml tqdm "sarif-pydantic==0.6.2" >/dev/null 2>&1 ||
    echo "setup: could not install matplotlib/pyyaml/tqdm/sarif-pydantic; the bench and doctor tests will fail"
fi
# Ray Train calls torch_tpu to train on tpu (tests/python/test_ray.py); it pins no torch.
if ! "$PY" -c "import ray.train" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" "ray[train]==2.60.0" >/dev/null 2>&1 ||
    echo "setup: could not install ray; the Ray Train test will be skipped"
fi
# TorchRec on tpu (tests/python/test_torchrec.py). torchrec names the CUDA fbgemm-gpu: it comes
# --no-deps, beside FBGEMM's CPU build (1.8.0: 1.9.0 fails to load on torch 2.13) and the rest
# of what it imports.
if ! "$PY" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
  { "$PY" -m pip install -q "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0" tensordict "torchmetrics==1.0.3" pyre-extensions \
      iopath >/dev/null 2>&1 && "$PY" -m pip install -q --no-deps "torchrec==1.9.2" >/dev/null 2>&1; } ||
    echo "setup: could not install torchrec; the TorchRec tests will be skipped"
fi
# JAX lowers JAX and Pallas kernels to StableHLO (torch_tpu.kernels); optional for users.
if ! "$PY" -c "import jax" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" "jax>=0.8" >/dev/null 2>&1 ||
    echo "setup: could not install jax; the JAX kernel tests will fail"
fi
if ! wait "$build_pid"; then
  cat "$build_log"
  echo "setup: building the extension failed"
  exit 1
fi
tail -1 "$build_log"
ENTRY_POINTS_CURRENT='import importlib.metadata as m, sys
sys.exit(not any(e.name == "torch_tpu" for e in m.entry_points(group="vllm.platform_plugins")))'
export ENTRY_POINTS_CURRENT
# Editable install: the package (its torch.backends autoload entry point, and the
# torch-tpu command) points at this checkout.
# Installed again where its entry points are older than pyproject.toml's (the vLLM plugin's name).
if ! "$PY" -m pip show -q torch_tpu >/dev/null 2>&1 || [ ! -x "$VENV/bin/torch-tpu" ] ||
  ! "$PY" -c "$ENTRY_POINTS_CURRENT" 2>/dev/null; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
fi
# The XLA FFI headers the CPU plugin's handlers are built against (the FFI kernel tests).
"$PY" -c "import torch_tpu.kernels as k; k.fetch_ffi_headers()" >/dev/null 2>&1 ||
  echo "setup: could not fetch the XLA FFI headers; the FFI kernel tests will fail"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
