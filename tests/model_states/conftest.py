"""Fixtures shared by the model-state tests."""

from __future__ import annotations

import pytest
import torch

from slotrunner.conformance import perturb_constants
from slotrunner.registry import tiny_config
from slotrunner.registry import tiny_configs as tc


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    """A tiny random-weight LLaVA checkpoint with its processor (one per test module)."""
    import transformers

    directory = tmp_path_factory.mktemp("llava")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(tiny_config("LlavaForConditionalGeneration"))
    perturb_constants(model)
    model.save_pretrained(str(directory))
    tc.llava_processor(model.config).save_pretrained(str(directory))
    return directory
