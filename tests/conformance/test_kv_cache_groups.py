"""KV-cache groups on the sliding-window architectures: slotrunner still equals transformers
while the blocks its windows have passed are freed and reused.

The tiny configs have a window of 6 tokens and the harness's 4-token blocks (2-token blocks in
the preempting batch), and every request here runs far past the window: a 40-token prompt
prefilled 5 tokens a step, then 20 decode steps; a batch of long requests in a cache of one
request's worth, so they preempt each other.

Guards against: the window off by one in the block manager (a block freed while a query still
reads a key in it: the logits move), a sliding-window layer reading the full-attention group's
table or the other way round (Gemma 3 and GPT-OSS mix them), NULL_BLOCK or a reused block read
unmasked, blocks never freed (a long request holding its whole length), and groups changing any
number: groups on and off give bit-identical logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from slotrunner.conformance import batch_variants, check_batch_invariance, check_requests, tiny_case
from slotrunner.core_runner.engine.block_manager import NULL_BLOCK
from slotrunner.conformance_oracle import ConformanceRequest
from slotrunner.conformance_recorder import run_recorded_prompt
from slotrunner.registry import tiny_config
from slotrunner.sampling_params import SamplingParams

WINDOW = 6  # every tiny config's sliding_window
# architecture -> its KV-cache groups with groups on (None: full attention)
ARCHS = {
    "MistralForCausalLM": (WINDOW,),  # every layer slides: one group, its blocks still leave
    "Gemma2ForCausalLM": (None, WINDOW),  # alternating: two groups of two layers
    "Gemma3ForCausalLM": (None, WINDOW, WINDOW, WINDOW),  # 3 sliding : 1 full, groups of one layer
    "GptOssForCausalLM": (None, WINDOW),
}
PROMPT_LEN, MAX_TOKENS, BUDGET = 40, 20, 5


class FreedBlocks:
    """Counts the sliding-window blocks each engine's block manager frees, and the most any
    request held at once in a sliding-window group. With `poison`, a freed block's K/V is
    overwritten at once with large values, as a reuse by another request would (prefix caching
    off): a query that still reads it unmasked gets other logits."""

    def __init__(self, poison: bool = False) -> None:
        self.freed = 0
        self.most_held = 0
        self.poison = poison

    def __call__(self, llm) -> None:
        bm = llm.engine.scheduler.block_manager
        free_outside_window = bm.free_outside_window

        def counted(req_id: str, num_computed: int) -> int:
            before = bm.held_block_ids(req_id)
            n = free_outside_window(req_id, num_computed)
            self.freed += n
            if self.poison and n:
                gone = torch.tensor(sorted(set(before) - set(bm.held_block_ids(req_id))))
                for cache in llm.engine.runner.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
                    cache[:, gone] = 1e3
            for g, window in enumerate(bm.windows):
                if window is not None and bm.has_blocks(req_id):
                    self.most_held = max(self.most_held, sum(b != NULL_BLOCK for b in bm.block_ids(req_id)[g]))
            return n

        bm.free_outside_window = counted


def _case(arch: str, tmp_path):
    return tiny_case(arch, tmp_path, tiny_config(arch, tie_word_embeddings=False))


def _long_prompt(vocab: int, seed: int, length: int = PROMPT_LEN) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_long_chunked_request_equals_transformers_while_blocks_leave(arch, tmp_path):
    case = _case(arch, tmp_path)
    llm = case.make_llm(max_num_seqs=1, max_num_batched_tokens=BUDGET)
    assert llm.config.kv_cache_windows == ARCHS[arch], "groups are on by default for sliding-window models"
    freed = FreedBlocks(poison=True)
    freed(llm)
    bm = llm.engine.scheduler.block_manager
    request = ConformanceRequest(_long_prompt(1000, 0))
    results = check_requests(llm, case.oracle, [request], MAX_TOKENS)
    assert all(r.passed for r in results), "\n".join(f"{r.name}: {r.worst:.2e} {r.detail}" for r in results)
    # Each sliding-window group frees about one block per 4 tokens once past the window; a
    # request holds at most the window plus a chunk: ceil((6 - 1 + 5) / 4) + 1 = 4 blocks.
    num_sliding = sum(w is not None for w in ARCHS[arch])
    assert freed.freed >= num_sliding * (PROMPT_LEN + MAX_TOKENS - WINDOW - 8) // 4
    assert 0 < freed.most_held <= 4
    assert bm.num_free_blocks == bm.num_blocks, "every block is back once the request finished"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_long_requests_preempting_each_other_equal_their_runs_alone(arch, tmp_path):
    case = _case(arch, tmp_path)
    windows = ARCHS[arch]
    prompts = [_long_prompt(1000, seed, length) for seed, length in enumerate([40, 23, 31, 9])]
    params = [
        SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(4)
    ]
    variants = [v for v in batch_variants(case.max_model_len, windows) if v.must_preempt]
    freed = FreedBlocks()
    results = check_batch_invariance(case.make_llm, prompts, params, variants, on_engine=freed, max_model_len=case.max_model_len)
    for result in results:
        assert result.passed and "preemptions" in result.detail, f"{result.name}: {result.detail}"
    assert freed.freed > 0


def test_groups_on_and_off_give_identical_logits(tmp_path):
    """Grouping moves K/V to other blocks only: every logit is bit for bit the same."""
    case = _case("Gemma3ForCausalLM", tmp_path)
    prompt = _long_prompt(1000, 3)
    runs = []
    for off in (False, True):
        llm = case.make_llm(max_num_seqs=1, max_num_batched_tokens=BUDGET, disable_hybrid_kv_cache_manager=off)
        assert len(llm.config.kv_cache_windows) == (1 if off else 4)
        runs.append(run_recorded_prompt(llm, prompt, MAX_TOKENS))
    assert runs[0].output_token_ids == runs[1].output_token_ids
    assert torch.equal(runs[0].logits, runs[1].logits)
