"""Phi-3's LongRoPE against transformers, at the limit where transformers switches factor sets.

transformers rotates a sequence by the long factors once it is longer than
`original_max_position_embeddings`, by the short ones before; its `generate` drops the cache and
recomputes the whole sequence at the crossing (from 5.24; 5.17 feeds that step one token).
slotrunner's cached keys cannot be re-rotated, so it uses one set for every position: long when
`max_position_embeddings` exceeds the limit, short otherwise (models/layers/rotary.py). Past the
limit the two agree at every position; within it, on a model that can outgrow it, they differ --
the documented divergence, pinned here.

Guards against: the wrong factor set chosen, short factors leaking into a sequence past the
limit (keys rotated by one set, queries by the other), the attention factor derived differently
from transformers, partial rotary with factors of the wrong length.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

from slotrunner import LLM
from slotrunner.conformance import build_case, compare_logits, hf_logits, run_recorded
from slotrunner.registry import tiny_config

LIMIT = 50  # original_max_position_embeddings of the sequence tests (max_position_embeddings 256)
PROMPT_LEN = LIMIT - 4  # the prompt fits; generate crosses the limit at its 5th decode step
MAX_TOKENS = 10
FP32_TOL = dict(atol=1e-6, rtol=1e-6)


def _tables(config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(our cos, our sin, transformers' cos, sin) for positions 0 .. num_positions - 1, the latter
    from one forward over them (long factors when num_positions exceeds the limit)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding

    hf = Phi3RotaryEmbedding(config)
    hf_cos, hf_sin = (t[0] for t in hf(torch.zeros(1), torch.arange(num_positions)[None]))
    rope = RopeConfig.from_hf(config)
    assert rope.attention_factor == hf.attention_scaling
    head_dim = config.hidden_size // config.num_attention_heads
    table = RotaryEmbedding(head_dim, config.max_position_embeddings, rope).cos_sin[:num_positions]
    half = table.shape[-1] // 2
    assert half == hf_cos.shape[-1] // 2, "partial rotary: one factor per rotated frequency"
    return table[:, :half], table[:, half:], hf_cos[:, :half], hf_sin[:, :half]


def test_long_factors_when_the_model_outgrows_the_limit_short_otherwise():
    long_config = tiny_config("Phi3ForCausalLM")  # limit 4, max_position_embeddings 256
    cos, sin, hf_cos, hf_sin = _tables(long_config, 64)
    assert long_config.rope_parameters["original_max_position_embeddings"] < 64
    torch.testing.assert_close(cos, hf_cos, **FP32_TOL)
    torch.testing.assert_close(sin, hf_sin, **FP32_TOL)

    short_config = tiny_config("Phi3ForCausalLM", max_position_embeddings=64, original_max_position_embeddings=64)
    cos, sin, hf_cos, hf_sin = _tables(short_config, 64)  # 64 positions: within the limit, short
    torch.testing.assert_close(cos, hf_cos, **FP32_TOL)
    torch.testing.assert_close(sin, hf_sin, **FP32_TOL)


def _case(tmp_path):
    hf = build_case(tiny_config("Phi3ForCausalLM", original_max_position_embeddings=LIMIT), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len=64)
    return hf, llm


def test_a_sequence_past_the_limit_is_transformers_at_every_position(tmp_path):
    """transformers' forward over a sequence past the limit (long factors everywhere) equals
    slotrunner's logits at every position, prefilled in chunks too; within the limit transformers
    uses the short factors, and there the two differ: the documented divergence."""
    hf, llm = _case(tmp_path)
    seq = torch.randint(3, 1000, (LIMIT + 6,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(hf, seq)
    for budget in (None, 7):
        chunked = llm if budget is None else LLM(
            str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=budget
        )  # fmt: skip
        ours = run_recorded(chunked, seq, 1).logits
        result = compare_logits(f"budget {budget}", ours, ref)
        assert result.passed, f"{result.detail}, worst {result.worst}"
    within = compare_logits("within the limit", ours[:LIMIT], hf_logits(hf, seq[:LIMIT]))
    assert not within.passed, "within the limit transformers uses the short factors: the divergence went away?"


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers < 5.24 drops generate's cache at the limit but feeds the model one token",
)
def test_generate_recomputes_past_the_limit_as_slotrunner_rotates(tmp_path):
    """`generate` crossing the limit recomputes the sequence with the long factors: its logits
    from the limit on equal slotrunner's on the same tokens (before it, short factors)."""
    hf, llm = _case(tmp_path)
    prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    hf_gen = torch.cat(out.logits).float()  # [MAX_TOKENS, vocab]: positions PROMPT_LEN - 1, ...
    seq = out.sequences[0, :-1].tolist()  # teacher-forced: every position sees generate's context
    ours = run_recorded(llm, seq, 1).logits[PROMPT_LEN - 1 :]
    past = LIMIT - (PROMPT_LEN - 1)  # first row at position LIMIT
    result = compare_logits("past the limit", ours[past:], hf_gen[past:])
    assert result.passed, f"{result.detail}, worst {result.worst}"
