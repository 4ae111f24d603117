#!/usr/bin/env bash
# torch_tpu on a GPU machine, through the CUDA PJRT plugin, in one timed run:
#   (a) build the extension with the machine's own python3, torch and cmake/ninja;
#   (b) run a subset of the tests with TORCH_TPU_PLUGIN=cuda;
#   (c) benchmark tpu (strict, fused, compiled) against PyTorch's cuda (eager, inductor)
#       side by side: per-op overhead, the GPT training step, Hugging Face generation;
#   (d) write every log, JSON and a summary under OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR                    # on the GPU machine
#   TORCH_TPU_PLUGIN=cpu PYTHON=.venv/bin/python bash scripts/gpu_check.sh OUT_DIR   # dry run here
#   bash scripts/gpu_check.sh --bundle                   # here: what the GPU machine lacks, in .gpu_bundle/
# Options after OUT_DIR: --ref cpu|cuda (PyTorch's device to compare with; default cuda with the
# cuda plugin, else cpu), --small (small models; the default with --ref cpu), --budget SECONDS
# (default 540: each step gets at most what is left, and a step that runs out is reported as
# such, not hung on), --workers N (pytest-xdist workers for the tests, default 8).
#
# The GPU machine has no network: the PJRT C API header (from the xla-cpu-pjrt wheel) must
# travel with the tree; --bundle copies it into .gpu_bundle/ (git-ignored), which this script
# finds there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}

if [ "${1:-}" = "--bundle" ]; then
  inc=$("$PY" -c "import os, xla_plugins.xla_cpu_pjrt as m; print(os.path.join(os.path.dirname(m.__file__), 'include'))")
  mkdir -p .gpu_bundle/include && cp "$inc/pjrt_c_api.h" .gpu_bundle/include/
  echo "gpu_check: .gpu_bundle/ is ready; carry it with the tree (device run: carry [\".gpu_bundle\"])"
  exit 0
fi

OUT=${1:?usage: gpu_check.sh OUT_DIR [--ref cpu|cuda] [--small] [--budget SECONDS] [--workers N] | --bundle}
shift
export TORCH_TPU_PLUGIN=${TORCH_TPU_PLUGIN:-cuda}
REF=$([ "$TORCH_TPU_PLUGIN" = cuda ] && echo cuda || echo cpu)
BUDGET=540
SMALL=""
WORKERS=8
while [ $# -gt 0 ]; do
  case $1 in
    --ref) REF=$2; shift 2 ;;
    --small) SMALL=1; shift ;;
    --budget) BUDGET=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -z "$SMALL" ] && SMALL=$([ "$REF" = cpu ] && echo 1 || echo 0)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Executables compiled in this run stay in this run (no stale cache from another machine),
# outside OUT so that OUT holds only what is worth reading.
export TORCH_TPU_CACHE_DIR
TORCH_TPU_CACHE_DIR=$(mktemp -d)
export PYTHONUNBUFFERED=1
START=$(date +%s)
SUMMARY="$OUT/summary.md"
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# step NAME SECONDS CMD...: runs CMD with its output in OUT/NAME.log, for at most SECONDS
# (or what is left of the budget), and notes the exit status and time.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  local rest
  rest=$(left)
  [ "$rest" -lt "$limit" ] && limit=$rest
  if [ "$limit" -le 5 ]; then
    note "- $name: skipped (budget spent)"
    return 99
  fi
  t0=$(date +%s)
  # Through bash, so that CMD may be one of the functions exported below.
  # SIGINT first: pytest then still reports what ran and writes its XML.
  timeout -s INT --kill-after=20 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local verdict="ok"
  [ $rc -ne 0 ] && verdict="FAILED (exit $rc)"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] || [ $rc -eq 130 ] && verdict="TIMED OUT after ${limit}s"
  note "- $name: $verdict, $(($(date +%s) - t0)) s"
  return $rc
}

note "# gpu_check $(date -u '+%Y-%m-%d %H:%M UTC'), plugin=$TORCH_TPU_PLUGIN, reference=$REF"
note "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)"

# ---- facts about the machine
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  nproc
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__)" 2>&1 | tail -1
  "$PY" -c "import sysconfig, os; p = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); print('Python.h', os.path.exists(p), p)"
  cmake --version | head -1
  ninja --version
} >"$OUT/facts.txt" 2>&1
sed 's/^/    /' "$OUT/facts.txt" >>"$SUMMARY"

# ---- (a) build
PJRT_INC=${PJRT_INCLUDE_DIR:-}
[ -z "$PJRT_INC" ] && [ -f .gpu_bundle/include/pjrt_c_api.h ] && PJRT_INC=$ROOT/.gpu_bundle/include
BUILD=build-gpu
PATH="$(dirname "$(command -v "$PY")"):$PATH"
# Configured here (the header's folder), then installed editable as users do, offline: the
# install registers the torch.compile backend and the device's autoload entry points.
build() {
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DTORCH_TPU_BUILD_TESTS=OFF ${PJRT_INC:+-DPJRT_INCLUDE_DIR="$PJRT_INC"} &&
    cmake --build "$BUILD" -j "$(nproc)" &&
    TORCH_TPU_BUILD_DIR="$ROOT/$BUILD" "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e .
}
export -f build
export PY ROOT BUILD PJRT_INC PATH
if ! step build 300 build; then
  tail -30 "$OUT/build.log" >>"$SUMMARY"
  exit 1
fi

# ---- a first op on the device: is the plugin there and working?
smoke() {
  "$PY" - <<'EOF'
import os, sys
sys.path.insert(0, os.getcwd())
import torch, torch_tpu
a = torch.randn(64, 64)
b = (a.to("tpu") @ a.to("tpu")).relu().cpu()
torch.testing.assert_close(b, (a @ a).relu())
print("platform", torch_tpu._C._platform(), "plugin", torch_tpu._C._plugin_path())
print("devices", torch.tpu.device_count(), torch.tpu.get_device_name(0))
EOF
}
export -f smoke
# A wrong answer here is reported and the run goes on: the tests and benchmarks say more.
if ! step smoke 120 smoke; then
  grep -v "^[EWI][0-9]" "$OUT/smoke.log" | tail -15 >>"$SUMMARY"
fi
sed 's/^/    /' "$OUT/smoke.log" | grep -E "platform|devices" >>"$SUMMARY"

# ---- the XLA transport across 2 processes: the client spanning them through the key-value
# bridge, and one all_reduce (on a one-GPU machine both ranks share the GPU: NCCL refuses it)
if [ "$TORCH_TPU_PLUGIN" = cuda ]; then
  step dist_span 90 env TORCH_TPU_DIST_TRANSPORT=xla "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 scripts/gpu_dist_span.py
  grep -E "^rank [0-9]:" "$OUT/dist_span.log" | sed 's/^/    /' >>"$SUMMARY"
fi

# ---- (c) benchmarks, side by side with PyTorch's own device
cd benchmarks
if [ "$SMALL" = 1 ]; then
  GPT="--n-layer 2 --n-head 4 --n-embd 64 --batch 8 --block 64 --steps 5 --rounds 2 --warmup 2"
  GEN="--hidden 64 --layers 2 --new-tokens 8 --rounds 2"
else
  GPT="--n-layer 6 --n-head 8 --n-embd 512 --batch 32 --block 256 --steps 20 --rounds 3 --warmup 3"
  GEN="--vocab 32000 --hidden 1024 --layers 8 --heads 16 --batch 8 --prompt 32 --new-tokens 32 --rounds 3"
fi
step op_overhead 60 "$PY" op_overhead.py --ref "$REF" --iters 100 --json "$OUT/op_overhead.json"
cd "$ROOT"

# ---- (b) the tests, on the plugin, compared with PyTorch on the CPU as always
TESTS=(tests/python/test_ops.py tests/python/test_views.py tests/python/test_autograd.py tests/python/test_modes.py
  tests/python/test_models.py tests/python/test_huggingface.py tests/python/test_compile.py)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$WORKERS")
step tests 180 "$PY" -m pytest -q -m "not slow" -p no:cacheprovider "${XDIST[@]}" \
  --junitxml="$OUT/tests.xml" -rfE "${TESTS[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -1 | sed 's/^/    /' >>"$SUMMARY"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" 2>/dev/null | head -40 | sed 's/^/    /' >>"$SUMMARY"

# ---- (c, continued) the GPT training step and generation, after the tests: correctness first
cd benchmarks
# shellcheck disable=SC2086
step gpt_train 170 "$PY" compiled.py --task train --ref "$REF" $GPT --json "$OUT/gpt_train.json"
# shellcheck disable=SC2086
step hf_generate 120 "$PY" hf_generate.py --ref "$REF" $GEN --json "$OUT/hf_generate.json"
cd "$ROOT"

# ---- (d) the tables
"$PY" benchmarks/gpu_report.py "$OUT" >>"$SUMMARY" 2>&1
note "- total: $(($(date +%s) - START)) s"
