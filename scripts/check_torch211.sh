#!/usr/bin/env bash
# torch_tpu must build and run against torch 2.11 as well as 2.13 (the GPU machine has 2.11).
# This copies the working tree to build-torch2.11/src, makes a second virtual environment
# there with torch 2.11.0 from PyPI (its CUDA build: PyPI has no CPU-only 2.11 wheel; it runs
# on the CPU), installs the copy into it (editable, so the torch.compile backend is
# registered as for users) and runs a sample of the tests on the CPU plugin.
#
#   bash scripts/check_torch211.sh [pytest args]   build, then the sample (or pytest args)
#   bash scripts/check_torch211.sh --prepare        only make the environment (downloads);
#                                                    scripts/test.sh runs this beside the tests
#   bash scripts/check_torch211.sh --gate           build, then the gate's smaller sample
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=$ROOT/build-torch2.11
VENV=$WORK/venv
SRC=$WORK/src
mkdir -p "$WORK"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
# The checks below import torch from this folder, where ./torch_tpu is the main build (for torch
# 2.13): torch's backend autoload would load it into torch 2.11 once a run has installed
# torch_tpu in this venv (a second run of the gate in one checkout failed so).
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
if ! "$PY" -c "import torch, xla_plugins.xla_cpu_pjrt, pytest, xdist, ninja, cmake, transformers, expecttest" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$PY" -m pip install -q "torch==2.11.0" numpy pytest pytest-xdist expecttest ninja "cmake>=3.24" "setuptools>=70" wheel \
    "xla-cpu-pjrt==0.0.1" "transformers>=5.17,<6" >"$WORK/pip.log" 2>&1 || { tail -20 "$WORK/pip.log"; exit 1; }
fi
"$PY" -c "import torch; assert torch.__version__.startswith('2.11'), torch.__version__"
if [ "${1:-}" = --prepare ]; then
  echo "check_torch211: environment ready (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
  exit 0
fi

# The working tree as it is (tracked and untracked files git does not ignore).
rm -rf "$SRC.new" && mkdir -p "$SRC.new"
git ls-files -z -co --exclude-standard | tar -c --null -T - -f - | tar -x -C "$SRC.new"
# Keep the previous copy's build folder: only what changed is rebuilt.
if [ -d "$SRC/build" ]; then mv "$SRC/build" "$SRC.new/build"; fi
[ -n "$(ls "$SRC"/torch_tpu/_C*.so 2>/dev/null)" ] && cp "$SRC"/torch_tpu/_C*.so "$SRC.new/torch_tpu/"
rm -rf "$SRC" && mv "$SRC.new" "$SRC"

export PATH="$VENV/bin:$PATH"
cd "$SRC"
unset TORCH_DEVICE_BACKEND_AUTOLOAD  # from here on, torch_tpu is this folder's build for torch 2.11
if [ ! -f build/build.ninja ]; then
  # ccache sees paths relative to the checkout (this environment lies outside the copy), so
  # the next clean clone's check compiles nothing that did not change.
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" -DTORCH_TPU_BUILD_TESTS=OFF \
    -DTORCH_TPU_CCACHE_BASEDIR="$ROOT" >/dev/null
fi
cmake --build build
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
echo "check_torch211: built against torch $("$PY" -c 'import torch; print(torch.__version__)')"

# A sample across the layers: views, autograd, the modes, torch.compile, models, and (not in
# the gate's sample, which keeps the rest: about half the time) the op-by-op tests.
sample=(tests/python/test_views.py tests/python/test_autograd.py tests/python/test_fused.py
        tests/python/test_compile.py tests/python/test_models.py)
if [ "${1:-}" = --gate ]; then
  shift
else
  sample+=(tests/python/test_ops.py)
fi
"$PY" -m pytest -q -m "not slow" -p no:cacheprovider -n "${TORCH_TPU_TEST_WORKERS:-2}" "$@" "${sample[@]}"
