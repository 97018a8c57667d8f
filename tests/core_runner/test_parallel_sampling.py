"""Parallel sampling (n > 1): one prefill, n samples, each equal to a seeded single request.

Guards against: children recomputing the prompt (the point of sharing), the copied partial
block missing the parent's last prompt tokens (children would diverge from the standalone
request), shared blocks freed while a sibling still reads them, samples that repeat each other.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams

N = 4
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8)


class TokenCounter:
    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_hook(lambda m, args, out: setattr(self, "count", self.count + args[0].numel()))

    def close(self):
        self.handle.remove()


@pytest.mark.parametrize("prompt_len", [9, 8], ids=["partial-last-block", "full-blocks"])
def test_n_samples_equal_seeded_single_requests_and_share_the_prefill(llm, prompt_len):
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(prompt_len)]}
    sp = dict(temperature=1.0, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    counter = TokenCounter(llm.engine.runner.model)
    try:
        out = llm.generate(prompt, SamplingParams(n=N, seed=100, **sp), use_tqdm=False)[0]
        forwarded = counter.count
    finally:
        counter.close()
    assert [c.index for c in out.outputs] == list(range(N))
    assert forwarded == prompt_len + N * (MAX_TOKENS - 1), "the prompt was computed more than once"
    singles = [
        llm.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0] for i in range(N)
    ]
    for i, (sample, single) in enumerate(zip(out.outputs, singles)):
        assert sample.token_ids == single.token_ids, f"sample {i} differs from the single request with seed {100 + i}"
        assert len(sample.logprobs) == MAX_TOKENS
        first = sample.token_ids[0]
        assert abs(sample.logprobs[0][first].logprob - single.logprobs[0][first].logprob) < 1e-5
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_parallel_samples_survive_scarce_blocks(tiny_llama_dir, async_scheduling):
    """With few blocks, forks fall back to recompute or get preempted; results don't change
    (also when steps are scheduled ahead of their parents' first tokens)."""
    prompts = [{"prompt_token_ids": [(17 * i + j) % 900 + 5 for i in range(11)]} for j in range(3)]
    sp = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=9, ignore_eos=True)
    roomy = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8)
    tight = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8, num_kv_blocks=16,
                async_scheduling=async_scheduling)
    a = roomy.generate(prompts, sp, use_tqdm=False)
    b = tight.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert tight.engine.scheduler.num_preemptions > 0
    bm = tight.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
