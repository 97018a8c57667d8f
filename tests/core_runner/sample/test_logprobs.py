"""Logprobs equal log_softmax; prompt logprobs equal the full-matrix computation.

Guards against: logprobs of processed instead of raw logits, wrong ranks, prompt logprobs
shifted by one position, chunk boundaries (of chunked prefill or of the 1024-row chunks)
dropping or duplicating positions.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.sample.logprobs import compute_logprobs_ref, prompt_logprobs_chunked

ATOL = 1e-4


def test_compute_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    chosen = torch.tensor([0, 17, 299, 5, 5])
    lp = compute_logprobs_ref(logits, chosen, k=3)
    full = logits.log_softmax(-1)
    torch.testing.assert_close(lp.logprobs[:, 0], full.gather(1, chosen[:, None])[:, 0])
    top = full.topk(3)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    expected_rank = (full > full.gather(1, chosen[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_rank)


def test_prompt_logprobs_chunks_equal_one_pass():
    torch.manual_seed(1)
    hidden = torch.randn(37, 8)
    weight = torch.randn(50, 8)
    targets = torch.randint(0, 50, (37,))
    one = prompt_logprobs_chunked(hidden, targets, 2, lambda h: h @ weight.t(), chunk=1000)
    chunked = prompt_logprobs_chunked(hidden, targets, 2, lambda h: h @ weight.t(), chunk=5)
    torch.testing.assert_close(one.logprobs, chunked.logprobs)
    assert torch.equal(one.token_ids, chunked.token_ids)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [64, 7], ids=["one-step", "chunked-prefill"])
def test_engine_logprobs_match_transformers(tiny_llama_dir, hf_model, budget):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=budget)
    prompt = [5, 9, 14, 200, 31, 77, 8, 120, 64, 3, 19]
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        full = hf_model(torch.tensor([seq])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        assert abs(entry[prompt[pos]].logprob - float(full[pos - 1, prompt[pos]])) < ATOL
        top = full[pos - 1].topk(2)
        for rank, tok in enumerate(top.indices.tolist(), start=1):
            assert abs(entry[tok].logprob - float(top.values[rank - 1])) < ATOL
    assert len(out.outputs[0].logprobs) == 6
    for i, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = full[len(prompt) - 1 + i]
        assert abs(entry[tok].logprob - float(row[tok])) < ATOL
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        assert len(entry) <= 4
