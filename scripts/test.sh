#!/usr/bin/env bash
# Installs the project and runs the whole test suite (CPU; Triton kernels run interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# The example out-of-tree plugin (docs/adding_a_model.md): installed like a user would install
# one, so its architectures arrive through the `slotrunner.plugins` entry point, and its own
# tests run with the suite. Built with the installed setuptools; an isolated build only if that
# one is too old to build it.
"$PY" -m pip install -q --no-deps --no-build-isolation -e examples/slotrunner-example-plugin \
  || "$PY" -m pip install -q --no-deps -e examples/slotrunner-example-plugin
exec "$PY" -m pytest tests examples/slotrunner-example-plugin/tests "$@"
