"""The capability tables (slotrunner/capabilities.py): generated from the ModelState and model
classes, kept in docs/capabilities.md, printed by `python -m slotrunner models`, and true.

Guards against: the docs table drifting from the classes' declarations; a flag that says
"refused" while the engine builder accepts the combination (or the other way round).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slotrunner.builder import _prefix_caching, _speculative
from slotrunner.capabilities import FEATURES, capability_rows, render_markdown
from slotrunner.core_runner.runner.model_state import ModelState
from slotrunner.capabilities import architecture_row
from slotrunner.registry import in_tree_architectures, model_state_classes, resolve, tiny_config
from slotrunner.tensor_parallel import check_tensor_parallel

DOC = Path(__file__).resolve().parent.parent / "docs" / "capabilities.md"
BEGIN, END = "<!-- capability table: generated -->\n", "<!-- end of capability table -->"
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def test_docs_tables_are_the_generated_ones():
    text = DOC.read_text()
    tables = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    generated = subprocess.run(
        [sys.executable, "-m", "slotrunner", "models", "--capabilities-markdown"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    assert generated.startswith(render_markdown(model_state_classes(in_tree_only=True)))
    assert tables == generated, (
        "docs/capabilities.md is stale: regenerate its tables with "
        "`python -m slotrunner models --capabilities-markdown`"
    )


@pytest.mark.parametrize("architecture", in_tree_architectures())
def test_refused_tensor_parallel_is_refused(architecture):
    name, state, tp, *_ = architecture_row(architecture)
    arch = resolve(tiny_config(architecture), architecture)
    if tp == "refused":
        with pytest.raises(ValueError, match="does not run tensor-parallel"):
            check_tensor_parallel(arch.model_cls, arch.model_state_cls.family, architecture, tiny_config(architecture), 2)
    else:
        assert callable(arch.model_cls.check_tensor_parallel)


def test_cli_prints_the_table_for_every_registered_family():
    out = subprocess.run(
        [sys.executable, "-m", "slotrunner", "models"], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    for cls in model_state_classes():
        assert any(line.startswith(cls.__name__ + " ") for line in out.splitlines()), cls.__name__
    for feature in FEATURES:
        assert feature.name in out


@pytest.mark.parametrize("state_cls", model_state_classes(), ids=lambda c: c.__name__)
def test_refused_entries_are_refused_by_the_builder(state_cls: type[ModelState]):
    (_, cells), = capability_rows([state_cls])
    status = dict(zip((f.name for f in FEATURES), cells))
    if status["prefix caching"].startswith("refused"):
        with pytest.raises(ValueError, match=state_cls.__name__):
            _prefix_caching(True, state_cls)
        assert _prefix_caching(None, state_cls) is False
    else:
        assert _prefix_caching(True, state_cls) is True and _prefix_caching(None, state_cls) is True
    if status["speculative decoding"] == "refused":
        with pytest.raises(ValueError, match=state_cls.__name__):
            _speculative(NGRAM, state_cls)
    else:
        assert _speculative(NGRAM, state_cls).num_speculative_tokens == 2


def test_rows_follow_the_flags():
    class Probe(ModelState):
        family = "probe"
        supports_cuda_graphs = True
        shares_prefix_kv = False
        supports_speculative_rollback = False

        def add_request(self, *args, **kwargs):  # noqa: ANN002, ANN003
            pass

    (name, cells), = capability_rows([Probe, Probe])  # duplicates collapse
    status = dict(zip((f.name for f in FEATURES), cells))
    assert name == "Probe"
    assert status["CUDA graphs"] == "yes (decode)"
    assert status["prefix caching"].startswith("refused") and status["speculative decoding"] == "refused"
    assert status["n > 1"] == "yes (prompt per sample)"

    class Checkpointing(Probe):
        shares_prefix_kv = True
        checkpoints_state = True

        def save_state_checkpoints(self, slots, entries):
            pass

    (_, cells), = capability_rows([Checkpointing])
    status = dict(zip((f.name for f in FEATURES), cells))
    assert status["CUDA graphs"] == "yes (decode)"
    assert status["prefix caching"] == "yes (default on; state checkpoints)"
    assert status["n > 1"] == "yes (prompt shared after the first sample's prefill)"

    class PrefillGraphs(Probe):
        cuda_graphs_for_prefill = True

    (_, cells), = capability_rows([PrefillGraphs])
    assert dict(zip((f.name for f in FEATURES), cells))["CUDA graphs"] == "yes (decode; one request's prefill too)"
