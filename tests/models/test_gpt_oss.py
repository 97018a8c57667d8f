"""GPT-OSS beyond the conformance case: YaRN at the real model's sizes, the expert layout, and
the checkpoints it refuses.

Guards against: YaRN frequencies or attention factor that match transformers only at tiny
sizes (the real config: head_dim 64, theta 150000, factor 32, original length 4096, no
truncation), gate/up columns de-interleaved the wrong way round, and an MXFP4 checkpoint loaded
as if its packed blocks were weights.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.models.gpt_oss import GptOssForCausalLM, _deinterleave
from slotrunner.models.layers.rotary import RopeConfig, _inv_freq
from slotrunner.registry import tiny_config


@pytest.mark.parametrize(
    "fields",
    [
        {},  # GptOssConfig's own defaults: the released models' rope
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 512,
                             "beta_fast": 16.0, "beta_slow": 2.0, "truncate": True}},
    ],
)  # fmt: skip
def test_yarn_frequencies_and_attention_factor_are_transformers(fields):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(**fields)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = RopeConfig.from_hf(config)
    torch.testing.assert_close(_inv_freq(rope, config.head_dim), inv_freq, atol=0, rtol=3e-7)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_interleaved_gate_up_becomes_gate_then_up():
    interleaved = torch.tensor([[10.0, 20.0, 11.0, 21.0, 12.0, 22.0]])  # g0 u0 g1 u1 g2 u2
    assert _deinterleave(interleaved).tolist() == [[10.0, 11.0, 12.0, 20.0, 21.0, 22.0]]


def test_quantized_checkpoints_are_refused():
    config = tiny_config("GptOssForCausalLM")
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="mxfp4.*bf16 checkpoint"):
        GptOssForCausalLM(config)
