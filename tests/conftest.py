"""Shared fixtures: tiny random-weight checkpoints saved once per test session."""

from __future__ import annotations

import pytest

from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """An untied tiny Llama saved with transformers (config.json + model.safetensors)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    return directory
