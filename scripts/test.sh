#!/usr/bin/env bash
# Installs the project and runs the whole test suite (CPU; Triton kernels run interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest tests "$@"
