"""Which heads, rows and vocabulary ids a rank owns.

Guards against: ranks that overlap or leave rows out (a head computed twice or never), KV heads
split when there are fewer of them than ranks (each rank must keep a whole head, shared by
several ranks), a last rank that reads past the vocabulary, and head counts that do not divide
passing silently (the model would compute garbage instead of refusing).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.core_runner.distributed.shard import check_head_split, even_shard, head_shard, vocab_shard


@pytest.mark.parametrize("total, world", [(8, 1), (8, 2), (8, 4), (128, 8)])
def test_even_shards_tile_the_dimension(total, world):
    shards = [even_shard(total, r, world, "rows") for r in range(world)]
    assert [s.start for s in shards] == [r * total // world for r in range(world)]
    assert sum(s.size for s in shards) == total


def test_kv_heads_fewer_than_ranks_are_replicated():
    shards = [head_shard(8, 2, r, 4) for r in range(4)]
    assert [(s.q.start, s.q.size) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv.start, s.kv.size) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert {s.kv_replicas for s in shards} == {2}
    # Query heads 0-3 use KV head 0 (GQA groups of 4): ranks 0 and 1 hold exactly those.
    for s in shards:
        assert s.q.start // 4 == s.kv.start


def test_kv_heads_at_least_ranks_are_split():
    assert [(s.kv.start, s.kv.size) for s in (head_shard(4, 2, r, 2) for r in range(2))] == [(0, 1), (1, 1)]


@pytest.mark.parametrize(
    "heads, kv, world, message",
    [(6, 2, 4, "num_attention_heads=6 is not divisible by tensor_parallel_size=4"),
     (12, 3, 2, "num_key_value_heads=3 is not divisible by tensor_parallel_size=2"),
     (24, 4, 6, "num_key_value_heads=4 is fewer than tensor_parallel_size=6 and does not divide it"),
     (8, 3, 4, "num_key_value_heads=3 is fewer than tensor_parallel_size=4")],
)  # fmt: skip
def test_head_counts_that_do_not_divide_are_refused(heads, kv, world, message):
    with pytest.raises(ValueError, match=message):
        check_head_split(heads, kv, world)


@pytest.mark.parametrize("vocab, world", [(1000, 2), (1001, 2), (5, 4), (7, 3)])
def test_vocab_shards_cover_the_vocabulary_once(vocab, world):
    per_rank = -(-vocab // world)
    owned = []
    for r in range(world):
        s = vocab_shard(vocab, r, world)
        assert 0 <= s.size <= per_rank and s.start + s.size <= vocab
        owned += range(s.start, s.start + s.size)
        if s.size:  # gathering ranks' padded slices in order puts id i at column i
            assert s.start == r * per_rank
    assert owned == list(range(vocab))


def test_narrow_is_a_view_of_the_checkpoint_tensor():
    """The rank's part is not copied before the parameter copy (a mapped file is read once, in part)."""
    t = torch.arange(24.0).view(6, 4)
    part = even_shard(6, 1, 3, "rows").narrow(t, 0)
    assert part.data_ptr() == t[2:4].data_ptr() and part.tolist() == t[2:4].tolist()
    with pytest.raises(ValueError, match="dimension 1 of shape"):
        even_shard(6, 0, 2, "rows").narrow(t, 1)
