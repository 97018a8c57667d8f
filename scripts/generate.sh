#!/usr/bin/env bash
# Installs slotrunner and the default model, then generates: with no arguments it asks the
# default model (SmolLM2-135M-Instruct) a question; arguments go to `python -m slotrunner generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  set -- "What is the capital of France?" "Write a haiku about the sea."
fi
exec "${PYTHON:-python3}" -m slotrunner generate "$@"
