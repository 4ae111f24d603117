#!/usr/bin/env bash
# The main job: set everything up, then train a small GPT on the shipped
# corpus on the tpu device (the CPU PJRT plugin where no accelerator is
# present) and on the CPU device, printing loss and tokens/s for both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/train_gpt.py "$@"
