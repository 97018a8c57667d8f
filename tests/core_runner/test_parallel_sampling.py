"""Parallel sampling (n > 1): n requests made at intake (sample i seeded with seed + i) that
share the prompt's full KV blocks through the prefix cache, each equal to a seeded single
request.

Guards against: samples recomputing the cached part of the prompt (the point of sharing), a
sample admitted in the same step reading blocks its sibling has not written, shared blocks
freed while a sibling still reads them, samples that repeat each other.
"""

from __future__ import annotations

import pytest

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


def generate_counting(llm, prompt, params):
    """The request's output and how many tokens the model forwarded for it."""
    counter = TokenCounter(llm.engine.runner.model)
    try:
        return llm.generate(prompt, params, use_tqdm=False)[0], counter.count
    finally:
        counter.close()


@pytest.mark.parametrize("prompt_len", [9, 8], ids=["partial-last-block", "full-blocks"])
def test_n_samples_equal_seeded_single_requests_and_share_the_prefill(llm, prompt_len):
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(prompt_len)]}
    sp = dict(temperature=1.0, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    llm.reset_prefix_cache()
    out, forwarded = generate_counting(llm, prompt, SamplingParams(n=N, seed=100, **sp))
    assert [c.index for c in out.outputs] == list(range(N))
    # Samples 1..N-1 take sample 0's full blocks, leaving at least one token to compute.
    shared = min(prompt_len // 4, (prompt_len - 1) // 4) * 4
    assert forwarded == prompt_len + (N - 1) * (prompt_len - shared) + N * (MAX_TOKENS - 1), "the prompt was recomputed"
    assert out.num_cached_tokens == 0, "sample 0 computed the prompt itself"
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
    """With few blocks, samples get preempted and recompute (hitting what is still cached);
    results don't change (also when steps are scheduled ahead of their tokens)."""
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


def test_without_prefix_caching_samples_recompute_and_agree(tiny_llama_dir):
    """enable_prefix_caching=False: every sample computes the whole prompt, with the same result."""
    prompt = {"prompt_token_ids": [(13 * i) % 900 + 5 for i in range(10)]}
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    on = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4)
    off = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=False)
    counter = TokenCounter(off.engine.runner.model)
    try:
        b = off.generate(prompt, sp, use_tqdm=False)[0]
    finally:
        counter.close()
    a = on.generate(prompt, sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert counter.count == 3 * 10 + 3 * 4
    assert b.num_cached_tokens == 0


def test_samples_share_a_prompt_past_the_window_in_kv_cache_groups(tmp_path):
    """KV-cache groups (tiny Gemma 3: a window of 6 beside full attention): siblings admitted
    in the same step take sample 0's full-attention blocks and only the sliding-window blocks
    their first query's window reads (positions before it get NULL_BLOCK), so they compute
    just their last token and still equal seeded single requests -- also chunked in a cache of
    36 blocks (one 64-token request needs 32), where samples are preempted and re-admitted."""
    from slotrunner.conformance import build_case
    from slotrunner.registry import tiny_config

    build_case(tiny_config("Gemma3ForCausalLM", tie_word_embeddings=False), tmp_path)
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(21)]}
    sp = dict(temperature=1.0, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True)
    args = dict(device="cpu", max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    llm = LLM(str(tmp_path), **args)
    assert len(llm.config.kv_cache_windows) == 4
    out, forwarded = generate_counting(llm, prompt, SamplingParams(n=N, seed=100, **sp))
    assert forwarded == 21 + (N - 1) * 1 + N * (MAX_TOKENS - 1), "siblings recomputed the shared prompt"
    singles = [llm.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0] for i in range(N)]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    tight = LLM(str(tmp_path), **(args | {"max_num_batched_tokens": 8}), num_kv_blocks=36)
    again = tight.generate([prompt] * 3, SamplingParams(n=N, seed=100, **sp), use_tqdm=False)
    assert all([c.token_ids for c in o.outputs] == [s.token_ids for s in singles] for o in again)
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm, tight):
        bm = engine.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
