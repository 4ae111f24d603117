#!/usr/bin/env bash
# Set up, then run the C++ units (ctest) and the Python tests (pytest).
# Extra arguments go to pytest (e.g. `-m "not slow"`, `-k views`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(pwd)/.venv/bin:$PATH"
status=0
if [ -x build/tpu_core_tests ]; then
  cmake --build build --target tpu_core_tests
  (cd build && ctest --output-on-failure) || status=1
fi
python -m pytest -q "$@" || status=1
exit $status
