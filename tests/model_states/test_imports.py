"""Import direction: registry -> models -> model_states -> core_runner, never the reverse.

Guards against: a model state importing `slotrunner.registry` (the multimodal intake once
resolved the model class per request to find its media handler; the engine now resolves it once
and hands it over in `IntakeContext.model_cls`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import slotrunner.model_states

MODEL_STATES = Path(slotrunner.model_states.__file__).parent


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_model_states_do_not_import_the_registry():
    files = sorted(MODEL_STATES.glob("*.py"))
    assert files, f"no modules under {MODEL_STATES}"
    offenders = {
        path.name: name
        for path in files
        for name in _imported_modules(path)
        if name == "slotrunner.registry" or name.startswith("slotrunner.registry.")
    }
    assert not offenders, f"model_states imports the registry: {offenders}"
