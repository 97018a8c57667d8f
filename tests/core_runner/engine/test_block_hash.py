"""Prefix-cache block hashes: extending a request's hashes step by step, in one pass over the
new blocks, gives each block `hash_block` of its parent, its tokens and the keys over it.

Guards against: a block hashed with a neighbour's tokens or at the wrong offset of the one-pass
conversion, a key span or the salt applied to blocks it does not touch, a chain that restarts
from the root between calls, or a row's tail (`start`) hashed at the wrong positions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from slotrunner.core_runner.engine.block_hash import append_block_hash, _ROOT, extend_block_hashes, hash_block


def _one_block_at_a_time(hashes, token_ids, num_tokens, block_size, key_spans=(), salt=None):
    for i in range(len(hashes), min(num_tokens, len(token_ids)) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        keys = [k for s, e, k in key_spans if s < end and e > start]
        if salt is not None:
            keys.insert(0, salt)
        block = np.asarray(token_ids[start:end], dtype=np.int64).tobytes()
        hashes.append(hash_block(hashes[-1] if hashes else _ROOT, block, keys))
    return hashes


@pytest.mark.parametrize("seed", range(6))
def test_extending_in_steps_equals_hashing_each_block(seed):
    rng = random.Random(seed)
    for _ in range(40):
        block_size = rng.choice([1, 3, 16])
        tokens = [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 100))]
        spans = [(a, a + rng.randrange(1, 20), f"media{a}") for a in sorted(rng.sample(range(100), rng.randrange(0, 4)))]
        salt = rng.choice([None, "adapter-7"])
        ours, tailed, expected = [], [], []
        for num_tokens in sorted(rng.sample(range(110), 3)):  # a prefill in chunks, then decode
            extend_block_hashes(ours, tokens, num_tokens, block_size, spans, salt)
            # The tokens from a position at or before the first block not hashed yet (a decode row's tail)
            start = max(0, len(tailed) * block_size - rng.randrange(0, 2 * block_size))
            extend_block_hashes(tailed, tokens[start:], num_tokens, block_size, spans, salt, start=start)
            _one_block_at_a_time(expected, tokens, num_tokens, block_size, spans, salt)
            assert ours == expected and tailed == expected


def test_same_prefix_same_hashes_and_a_changed_token_changes_the_rest():
    a = extend_block_hashes([], list(range(64)), 64, 16)
    b = extend_block_hashes([], list(range(40)) + [999] + list(range(41, 64)), 64, 16)
    assert len(a) == 4 and a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_decode_rows_filling_one_block_at_a_time_hash_as_each_block(block_size):
    """A decode row adds one block at a time, from its tail (the one-block path, without a key)."""
    rng = random.Random(block_size)
    tokens = [rng.randrange(0, 200_000) for _ in range(5 * block_size + 2)]
    ours, expected, appended = [], [], []
    for num_tokens in range(len(tokens) + 1):
        start = len(ours) * block_size
        extend_block_hashes(ours, tokens[start:], num_tokens, block_size, start=start)
        _one_block_at_a_time(expected, tokens, num_tokens, block_size)
        if num_tokens // block_size > len(appended):  # the scheduler's own call for such a row
            append_block_hash(appended, tokens[len(appended) * block_size : num_tokens])
        assert ours == expected == appended
    assert len(ours) == len(tokens) // block_size
