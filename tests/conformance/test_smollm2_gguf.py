"""Real weights: SmolLM2-135M-Instruct (GGUF) through slotrunner equals transformers.

Guards against: a dequantization or q/k un-permutation error that tiny random models cannot
show, tokenizer or chat-template drift, numerical drift over 30 real layers.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import check_case, compare_greedy, hf_logits

# Real logits reach ~30 in magnitude and pass 30 layers: fp32 accumulation-order noise between
# two correct implementations is ~1e-4 absolute.
ATOL = 1e-3
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def systems(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    llm = LLM(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    prompts = [llm.render_chat([{"role": "user", "content": q}])["prompt_token_ids"] for q in QUESTIONS]
    return llm, hf, prompts


def test_france_answers_paris(systems):
    llm, _, _ = systems
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_batched_greedy_tokens_equal_transformers(systems):
    llm, hf, prompts = systems
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        # transformers' greedy choice after each of our prefixes, from one forward over prompt +
        # ours: if every token we chose is it (or a near-tie), `generate` would have chosen the
        # same sequence. Its 64 eager steps a prompt took ~55 s of a 2-core CI machine.
        seq_logits = hf_logits(hf, prompt + ours)
        ref = seq_logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        result = compare_greedy("tokens", ours, ref, seq_logits, len(prompt), atol=ATOL)
        assert result.passed, result.detail
        assert len(ours) == MAX_TOKENS


def test_logits_at_every_position_match(systems):
    llm, hf, prompts = systems
    report = check_case(llm, hf, prompts[:2], 16, atol=ATOL)
    assert report.passed, report.table()
