"""Gemma pieces that float32 conformance cannot see, against transformers' own modules.

Guards against: the (1 + w) norm rounded like Llama's (h to bf16 before the weight: bf16 results
drift from transformers), the fused residual form of the four-norm layer adding in another
dtype, sqrt(hidden) applied in float32 instead of rounded to the model's dtype (55.4256 vs 55.5
in bf16 for hidden 3072), Gemma 3's per-layer-type RoPE misread from the legacy config fields
(`rope_local_base_freq`, `rope_scaling` for global layers only, `sliding_window_pattern`), and
configs this implementation does not serve accepted silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slotrunner.registry import tiny_config


def test_unit_offset_norm_is_gemmas_bitwise_in_bf16():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from slotrunner.models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    hf, ours = Gemma2RMSNorm(96, eps=1e-6), RMSNorm(96, 1e-6, unit_offset=True)
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(96, generator=gen))
        ours.weight.copy_(hf.weight)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = (3 * torch.randn(7, 96, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(7, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
    out, summed = ours(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(out, hf(residual + x))


def test_embedding_scale_is_rounded_to_the_model_dtype():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from slotrunner.models.causal_lm import DecoderStack, StackNames

    hidden = 3072  # sqrt: 55.4256..., 55.5 in bf16
    hf = Gemma2TextScaledWordEmbedding(10, hidden, 0, embed_scale=hidden**0.5)
    stack = DecoderStack(StackNames(), 10, hidden, [], nn.Identity(), embedding_multiplier=hidden**0.5, multiplier_in_dtype=True)
    with torch.no_grad():
        stack.token_embedding.weight.copy_(hf.weight)
    ids = torch.arange(10)
    for dtype in (torch.float32, torch.bfloat16):
        hf_out = hf.to(dtype)(ids[None])[0]
        assert torch.equal(stack.to(dtype)(ids, ids, None), hf_out), dtype


def test_gemma3_rope_per_layer_type_from_legacy_fields():
    import transformers

    from slotrunner.models.gemma import FULL, SLIDING, GemmaArgs

    config = transformers.Gemma3TextConfig(
        num_hidden_layers=7, sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=300.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    args = GemmaArgs.from_hf(config, qk_norm=True, attn_soft_cap=False)
    assert args.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)
    local, full = args.ropes[SLIDING], args.ropes[FULL]
    assert (local.theta, local.rope_type) == (300.0, "default")
    assert (full.theta, full.rope_type, full.factor) == (5e5, "linear", 8.0)


def test_gemma3_ignores_attention_soft_cap_as_transformers_does():
    """transformers' Gemma3 attention never passes `attn_logit_softcapping` on."""
    from slotrunner.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM

    assert Gemma3ForCausalLM(tiny_config("Gemma3ForCausalLM", attn_logit_softcapping=5.0)).args.attn_soft_cap is None
    assert Gemma2ForCausalLM(tiny_config("Gemma2ForCausalLM", attn_logit_softcapping=5.0)).args.attn_soft_cap == 5.0


def test_bidirectional_gemma3_is_refused():
    from slotrunner.models.gemma import Gemma3ForCausalLM

    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(tiny_config("Gemma3ForCausalLM", use_bidirectional_attention=True))
