"""Which decode steps attend a shared prompt prefix in one launch (AttentionMetadata.shared_prefix_len).

The launch itself is tested against the decode launch in tests/core_runner/attention/
test_triton_attn.py (bitwise) and on the GPU in test_cuda_graphs.py; here, on the CPU, the
runner's choice of the prefix: the CPU backends have no such launch, so a runner is told the
Triton backend's granule and its batches are observed.

Guards against: a prefix that some row does not share (a row whose blocks differ, in any
KV-cache group), one that reaches a row's query or its unwritten keys, a prefix not a whole
number of granules, and a step with a prefill chunk or too few rows taking the launch.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.runner.block_table import BlockTables
from slotrunner.core_runner.runner.model_runner import SHARED_PREFIX_MIN_ROWS, SHARED_PREFIX_MIN_TOKENS
from slotrunner.registry import tiny_config


def test_shared_prefix_blocks():
    tables = BlockTables(max_num_reqs=6, max_num_blocks_per_req=8, block_size=4, device=torch.device("cpu"), num_groups=2)
    for slot, ids in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3, 4, 7], [8, 2, 3, 4, 5])):
        tables.reset(slot, [ids, [i + 100 for i in ids]])
    tables.reset(4, [[1, 2, 3, 4, 5], [101, 102, 0, 104, 105]])  # group 1 differs at block 2
    slots = np.array([0, 2])
    assert tables.shared_prefix_blocks(slots, 5) == 4
    assert tables.shared_prefix_blocks(slots, 3) == 3  # never past the limit
    assert tables.shared_prefix_blocks(np.array([0, 1, 2]), 5) == 3
    assert tables.shared_prefix_blocks(np.array([0, 3]), 5) == 0
    assert tables.shared_prefix_blocks(np.array([0, 4]), 5) == 2
    assert tables.shared_prefix_blocks(np.array([1]), 5) == 5
    assert tables.shared_prefix_blocks(slots, 0) == 0
    # The same rows step after step (the answer is kept): the limit grows, shrinks (rejected
    # drafts), and a slot starting over with other blocks is seen.
    both = np.array([0, 2])
    tables.append(0, [[6, 7], [106, 107]])
    tables.append(2, [[6, 8], [106, 108]])
    assert [tables.shared_prefix_blocks(both, n) for n in (2, 4, 6, 7, 3, 7)] == [2, 4, 4, 4, 3, 4]
    tables.reset(2, [[1, 2, 3, 4, 5, 6, 7], [101, 102, 103, 104, 105, 106, 107]])
    assert tables.shared_prefix_blocks(both, 7) == 7
    tables.reset(2, [[1, 9, 3, 4, 5, 6, 7], [101, 109, 103, 104, 105, 106, 107]])
    assert tables.shared_prefix_blocks(both, 7) == 1


def test_decode_steps_over_a_cached_prompt_take_the_shared_prefix(tmp_path):
    from slotrunner.conformance import build_case

    config = tiny_config("Qwen3ForCausalLM")
    config.max_position_embeddings = 512
    build_case(config, tmp_path)
    block_size, granule, shared_tokens = 16, 32, 300
    llm = LLM(str(tmp_path), device="cpu", max_model_len=512, max_num_seqs=16, block_size=block_size)
    runner = llm.engine.runner
    assert runner._shared_prefix_granule is None  # the CPU backends have no shared-prefix launch
    runner._shared_prefix_granule = granule  # as the Triton backend's: only the choice is observed here
    seen: list[tuple[int, int, int, int]] = []  # (rows, longest query, shortest context, shared prefix)
    runner.add_step_observer(
        lambda batch, _: seen.append(
            (batch.num_reqs, int(batch.num_scheduled_tokens_np.max()), int(batch.num_computed_tokens_np.min()),
             batch.shared_prefix_len)
        )
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 200, (shared_tokens,), generator=gen).tolist()
    rows = SHARED_PREFIX_MIN_ROWS + 2
    prompts = [{"prompt_token_ids": prefix + torch.randint(5, 200, (3 + 7 * i,), generator=gen).tolist()} for i in range(rows)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(rows)]
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), device="cpu", max_model_len=512, max_num_seqs=16,
                                              block_size=block_size, enable_prefix_caching=False)
            .generate(prompts, params, use_tqdm=False)]  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    expected = shared_tokens // block_size * block_size // granule * granule
    assert expected >= SHARED_PREFIX_MIN_TOKENS
    for num_reqs, max_query, min_context, shared in seen:
        qualifies = num_reqs >= SHARED_PREFIX_MIN_ROWS and max_query == 1
        assert shared == (expected if qualifies else 0), (num_reqs, max_query, min_context, shared)
        assert shared <= min_context
    assert sum(1 for *_, shared in seen if shared) >= 5, seen
