"""StateCheckpoints and the scheduler's use of it: where a recurrent family's state is saved,
and which prefix-cache hits such a family may take.

Guards against: a hit that ends where no state was checkpointed (the restored state would belong
to a shorter or another prefix: silently wrong outputs), a chunk that runs past a checkpoint
position (no state exists there to save), a checkpoint saved under the hash of the wrong block,
a checkpoint read in the step that writes it (the restore runs before the forward), an eviction
that takes an entry a step is about to write, and a lost checkpoint that breaks the fallback to a
shorter hit or to a full recompute.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.block_hash import extend_block_hashes
from slotrunner.core_runner.engine.request import Request
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.engine.state_checkpoints import StateCheckpoints
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.sampling_params import SamplingParams

BLOCK = 4


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) for i in range(n)]


def test_positions_every_interval_and_at_the_last_full_block_before_the_last_token():
    ck = StateCheckpoints(4, interval=8, block_size=BLOCK)
    walk, pos = [], 0
    while (pos := ck.next_position(pos, 27)) is not None:
        walk.append(pos)
    assert walk == [8, 16, 24]  # (27 - 1) // 4 * 4 = 24
    # A prompt of whole blocks: its last block is computed again by an identical prompt, so the
    # checkpoint that one can use ends a block earlier.
    assert ck.next_position(16, 24) == 20 and ck.next_position(20, 24) is None
    assert ck.next_position(0, 4) is None  # one block: nothing to hit before the last token
    assert StateCheckpoints(1, interval=10, block_size=BLOCK).interval == 8  # whole blocks
    assert StateCheckpoints(1, interval=1, block_size=BLOCK).interval == BLOCK


def test_longest_hit_is_the_longest_prefix_with_a_readable_checkpoint():
    ck = StateCheckpoints(4, interval=8, block_size=BLOCK)
    h = _hashes(6)
    assert ck.longest_hit(h, 6) == (0, None, False)
    e2, e4 = ck.reserve(h[1]), ck.reserve(h[3])
    assert ck.longest_hit(h, 6) == (0, None, True), "checkpoints of the step being scheduled are not readable yet"
    ck.end_step()
    assert ck.longest_hit(h, 6) == (4, e4, False)
    assert ck.longest_hit(h, 3) == (2, e2, False), "the cached chain bounds the hit"
    assert ck.reserve(h[3]) is None, "a prefix checkpointed already is not saved twice"
    e6 = ck.reserve(h[5])
    assert ck.longest_hit(h, 6) == (4, e4, True)
    ck.end_step()
    assert ck.longest_hit(h, 6) == (6, e6, False)
    assert len({e2, e4, e6}) == 3


def test_least_recently_used_is_overwritten_never_a_pending_one():
    ck = StateCheckpoints(2, interval=8, block_size=BLOCK)
    a, b, c, d = _hashes(4)
    ea, eb = ck.reserve(a), ck.reserve(b)
    assert ck.reserve(c) is None, "every entry is being written this step"
    ck.end_step()
    ck.longest_hit([a], 1)  # a is used: b is now the least recently used
    assert ck.reserve(c) == eb
    assert ck.longest_hit([b], 1) == (0, None, False)
    assert ck.reserve(d) == ea, "c is pending: a goes even though it was used more recently than c was written"
    ck.reset()
    assert len(ck) == 0 and ck.longest_hit([c, d], 2) == (0, None, False)


# -- the scheduler -------------------------------------------------------------------------------


def _scheduler(**overrides: int) -> Scheduler:
    kwargs = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=BLOCK, num_kv_blocks=64,
                  vocab_size=2000, num_state_checkpoints=8, state_checkpoint_interval=8)  # fmt: skip
    kwargs.update(overrides)
    config = EngineConfig(model="fake", device=torch.device("cpu"), dtype=torch.float32, **kwargs)
    return Scheduler(config, prefix_caching=True)


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True), (), arrival=0, seed=0)


def _run_step(scheduler: Scheduler):
    """Schedule a step and sample a token (7) for every row that completes its tokens."""
    out = scheduler.schedule()
    by_id = {r.req_id: r for r in scheduler.running}
    sampled = [[7] if by_id[r].num_computed_tokens >= by_id[r].num_tokens else [] for r in out.num_scheduled_tokens]
    scheduler.update(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
    return out


def _block_hash(prompt: list[int], num_blocks: int) -> bytes:
    return extend_block_hashes([], prompt, num_blocks * BLOCK, BLOCK)[num_blocks - 1]


PROMPT = list(range(100, 127))  # 27 tokens: checkpoints at 8, 16 (interval) and 24 (last full block)


def test_prefill_chunks_end_at_checkpoints_and_save_them_under_their_last_block():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", PROMPT))
    chunks, saved = [], []
    while scheduler.has_unfinished_requests():
        out = _run_step(scheduler)
        chunks.append(out.num_scheduled_tokens.get("a"))
        saved += list(out.state_checkpoints.items())
    assert chunks == [8, 8, 8, 3, 1], "the budget (64) would take the prompt at once; checkpoints cut it"
    assert len(saved) == 3 and len({e for _, e in saved}) == 3
    for n in (2, 4, 6):  # each save is findable under the hash of the block it ends
        assert scheduler.state_checkpoints.longest_hit([_block_hash(PROMPT, n)], 1)[0] == 1


def test_a_hit_ends_at_the_longest_checkpointed_prefix_mid_prompt():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", PROMPT))
    while scheduler.has_unfinished_requests():
        _run_step(scheduler)
    # Shares a's first 18 tokens: blocks 1..4 are cached, the state is checkpointed after 16.
    other = PROMPT[:18] + [5, 6, 7, 8, 9]
    scheduler.add_request(_request("b", other))
    out = _run_step(scheduler)
    (new,) = out.new_reqs
    assert new.num_computed_tokens == 16 and new.state_checkpoint is not None
    assert out.num_scheduled_tokens["b"] == 4, "from 16 to its own last full block (20): a checkpoint"
    assert list(out.state_checkpoints) == ["b"]


def _finish(scheduler: Scheduler, req_id: str, prompt: list[int]) -> int:
    """Run a request to its end; the prompt tokens it found cached."""
    scheduler.add_request(request := _request(req_id, prompt))
    while scheduler.has_unfinished_requests():
        _run_step(scheduler)
    return request.num_cached_tokens


def test_an_overwritten_checkpoint_falls_back_to_a_shorter_hit():
    scheduler = _scheduler(num_state_checkpoints=3)
    _finish(scheduler, "a", PROMPT)  # checkpoints after 8, 16, 24
    assert _finish(scheduler, "p", PROMPT[:10] + [1, 2]) == 8  # uses a's first: a's after 16 is now the oldest
    _finish(scheduler, "x", [900] * 12)  # its checkpoint (after 8) overwrites a's after 16
    # Shares a's first 18 tokens (4 cached blocks): the state after 16 is gone, the one after 8 is not.
    assert _finish(scheduler, "b", PROMPT[:18] + [5, 6, 7, 8, 9]) == 8


def test_without_any_checkpoint_of_a_cached_chain_the_prompt_is_recomputed():
    scheduler = _scheduler(num_state_checkpoints=1)
    _finish(scheduler, "a", PROMPT)  # each checkpoint overwrites the one before: only a's after 24 stays
    other = PROMPT[:18] + [5, 6, 7, 8, 9]
    kv_chain = scheduler.block_manager.find_cached(extend_block_hashes([], other, len(other), BLOCK), 5)
    assert kv_chain.num_blocks == 4, "its first 4 blocks' KV is cached..."
    assert _finish(scheduler, "b", other) == 0, "...but no state after them is: it computes from token 0"


def test_a_sibling_waits_for_the_checkpoint_being_written_then_restores_it():
    scheduler = _scheduler(state_checkpoint_interval=64)
    for req_id in ("s0", "s1"):
        scheduler.add_request(_request(req_id, PROMPT))
    first = _run_step(scheduler)
    assert list(first.num_scheduled_tokens) == ["s0"] and first.num_scheduled_tokens["s0"] == 24
    assert "s0" in first.state_checkpoints
    second = _run_step(scheduler)
    (new,) = second.new_reqs
    assert new.req_id == "s1" and new.num_computed_tokens == 24
    assert new.state_checkpoint == first.state_checkpoints["s0"]


def test_a_reset_forgets_the_checkpoints_with_the_blocks():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", PROMPT))
    out = scheduler.schedule()
    scheduler.release_step_slots(out)  # the step failed: what it reserved was never written
    assert len(scheduler.state_checkpoints) == 0
