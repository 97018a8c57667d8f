"""The layering of docs/architecture.md, checked on the source: every `slotrunner` import (at
module level or inside a function) must point down the documented direction.

    slotrunner (face) -> registry -> models -> model_states -> models.layers
        -> core_runner: engine -> runner -> {attention, sample, cpu, distributed}; loader -> cpu
    (models and models.layers may import core_runner.distributed: the sharded layers)
    leaves (importable from anywhere): sampling_params, outputs, config, triton_utils, graph_capture, intake

Guards against: a layer importing a model (models.layers.multimodal_lm importing models.llama),
cycles between the contract and the families (models.layers and model_states importing each
other through model_states.interface: layers now import only core_runner, states may import
the layers they bind state to), the runner importing a model layer (kv_cache importing
models.layers.attention), the attention backend importing the runner's InputBatch, sampling
importing the engine's scheduler output, the loader importing the registry, and model states
resolving architectures themselves (model_states importing the registry).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"slotrunner": "slotrunner", "core_runner": "slotrunner.core_runner", "model_states": "slotrunner.model_states",
           "models": "slotrunner.models", "registry": "slotrunner.registry"}

# Modules anything may import; they import only each other.
LEAVES = {
    "slotrunner.sampling_params",
    "slotrunner.outputs",
    "slotrunner.core_runner.config",
    "slotrunner.core_runner.triton_utils",
    "slotrunner.core_runner.graph_capture",
    "slotrunner.core_runner.engine.intake",
}

# unit -> the units it may import (besides itself and the leaves).
ALLOWED = {
    "face": {"registry", "models", "layers", "model_states", "engine", "runner", "attention", "sample", "cpu", "loader",
             "distributed"},
    "registry": {"models", "layers", "model_states", "engine", "runner", "attention", "sample", "cpu", "loader"},
    "models": {"model_states", "layers", "runner", "attention", "cpu", "loader", "distributed"},
    "model_states": {"layers", "runner", "attention"},
    "layers": {"runner", "attention", "cpu", "loader", "distributed"},
    "engine": {"runner", "attention", "sample"},
    "runner": {"attention", "sample", "cpu", "spec_decode", "distributed"},
    "distributed": set(),  # process groups, collectives, shard arithmetic: the runner and layers call them
    "spec_decode": {"attention"},  # speculators and verification: the runner calls them (a draft model attends)
    "attention": set(),
    "sample": set(),
    "cpu": {"attention"},
    "loader": {"cpu"},
    "leaf": set(),
}


def unit(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    parts = module.split(".")
    if parts[:2] == ["slotrunner", "core_runner"]:
        return parts[2] if len(parts) > 2 and parts[2] in ALLOWED else "leaf"  # core_runner/__init__
    if parts[:3] == ["slotrunner", "models", "layers"]:
        return "layers"
    if len(parts) > 1 and parts[1] in ("models", "model_states", "registry"):
        return parts[1]
    return "face"


def source_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            modules[".".join((package, *rel)).removesuffix(".__init__")] = path
    return modules


def imports_of(module: str, path: Path) -> set[str]:
    """Every slotrunner module `module` imports, resolved to the longest known module name."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "slotrunner" or m.startswith("slotrunner.")}


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in sorted(modules.items()):
        src = unit(module)
        for target in sorted(imports_of(module, path)):
            if target not in modules:
                continue  # a name imported from a module, already counted as that module
            dst = unit(target)
            if dst == src or (dst == "leaf" and src != "leaf") or dst in ALLOWED[src]:
                continue
            if src == "leaf" and dst == "leaf":
                continue
            bad.append(f"{module} ({src}) imports {target} ({dst})")
    return bad


def test_every_import_follows_the_documented_direction():
    bad = violations(source_modules())
    assert not bad, "imports against docs/architecture.md's direction:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, target",
    [
        ("slotrunner.models.layers.cross_attention", "slotrunner.models.llama"),  # a layer importing a model
        ("slotrunner.core_runner.runner.kv_cache", "slotrunner.models.layers.norm"),  # runner -> model layer
        ("slotrunner.core_runner.attention.backend", "slotrunner.core_runner.runner.input_batch"),  # attention -> runner
        ("slotrunner.core_runner.sample.sampling_states", "slotrunner.core_runner.engine.scheduler"),  # sample -> engine
        ("slotrunner.core_runner.runner.model_runner", "slotrunner.model_states.default"),  # runner -> a family
        ("slotrunner.core_runner.loader.model_loader", "slotrunner.registry"),  # loader -> registry
        ("slotrunner.model_states.multimodal", "slotrunner.registry"),  # a family resolving architectures
        ("slotrunner.models.layers.mamba.mixer", "slotrunner.model_states.recurrent_hybrid"),  # a layer -> a family
        ("slotrunner.model_states.recurrent_hybrid", "slotrunner.models.bamba"),  # a family -> a model
        ("slotrunner.core_runner.engine.intake", "slotrunner.core_runner.engine.scheduler"),  # a leaf importing up
        ("slotrunner.core_runner.distributed.parallel_state", "slotrunner.core_runner.runner.model_runner"),  # up
    ],
)
def test_the_check_fails_on_an_upward_edge(module, target, tmp_path):
    """The check is not vacuous: each edge the layering forbids, added to its module, is reported."""
    modules = source_modules()
    patched = tmp_path / "patched.py"
    patched.write_text(modules[module].read_text() + f"\nimport {target}\n")
    modules[module] = patched
    assert any(line.startswith(f"{module} (") and f"imports {target} (" in line for line in violations(modules))
