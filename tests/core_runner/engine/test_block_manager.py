"""BlockManager: block accounting under grow/free, and the prefix cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotrunner.core_runner.engine.block_hash import extend_block_hashes
from slotrunner.core_runner.engine.block_manager import BlockManager

NUM_BLOCKS = 16
BLOCK_SIZE = 4


def _check_invariants(bm: BlockManager, req_ids: list[str]) -> None:
    held = [b for r in req_ids for b in bm.block_ids(r)]
    free = list(bm._free)
    assert len(set(held)) == len(held), "a block is held twice"
    assert len(set(free)) == len(free), "a block is on the free list twice"
    assert not set(held) & set(free), "a held block is also free"
    assert set(held) | set(free) == set(range(bm.num_blocks)), "a block leaked"
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == len(held)


def test_grow_returns_only_new_blocks() -> None:
    """Guards against grow() returning the whole table: the runner appends what it gets, so
    returning old ids would duplicate them in its block table."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    first = bm.grow("a", 5)  # 2 blocks
    assert len(first) == 2
    assert bm.grow("a", 8) == []  # still fits in 2 blocks
    third = bm.grow("a", 9)
    assert len(third) == 1 and third[0] not in first
    assert bm.block_ids("a") == first + third
    assert bm.num_blocks_to_grow("a", 4) == 0  # never shrinks


def test_block_count_boundaries() -> None:
    """Guards against off-by-one block counts at exact multiples of block_size."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    assert bm.num_blocks_to_grow("a", 0) == 0
    assert bm.num_blocks_to_grow("a", 1) == 1
    assert bm.num_blocks_to_grow("a", BLOCK_SIZE) == 1
    assert bm.num_blocks_to_grow("a", BLOCK_SIZE + 1) == 2


def test_grow_past_capacity_asserts_and_changes_nothing() -> None:
    """Guards against a half-done allocation when the scheduler forgot can_grow()."""
    bm = BlockManager(4, BLOCK_SIZE)
    bm.grow("a", 3 * BLOCK_SIZE)
    assert not bm.can_grow("b", 2 * BLOCK_SIZE)
    with pytest.raises(AssertionError, match="can_grow"):
        bm.grow("b", 2 * BLOCK_SIZE)
    assert bm.num_free_blocks == 1 and bm.block_ids("b") == []


def test_free_is_a_noop_without_blocks() -> None:
    """Guards against a double free putting a block on the free list twice."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    bm.free("never-grown")
    bm.grow("a", 10)
    bm.free("a")
    bm.free("a")
    _check_invariants(bm, ["a"])
    assert bm.num_free_blocks == NUM_BLOCKS


_ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(0, 3 * BLOCK_SIZE)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_random_grow_free_never_leaks(ops: list[tuple[str, int, int]]) -> None:
    """Guards against leaked or doubly owned blocks over any sequence of grow/free."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    req_ids = [f"r{i}" for i in range(6)]
    wanted = {r: 0 for r in req_ids}  # tokens each request asked room for since its last free
    for op, idx, extra in ops:
        req_id = req_ids[idx]
        if op == "grow":
            target = wanted[req_id] + extra
            if bm.can_grow(req_id, target):
                new = bm.grow(req_id, target)
                assert bm.block_ids(req_id)[len(bm.block_ids(req_id)) - len(new) :] == new
                wanted[req_id] = target
            else:
                with pytest.raises(AssertionError):
                    bm.grow(req_id, target)
        else:
            bm.free(req_id)
            wanted[req_id] = 0
        assert len(bm.block_ids(req_id)) == -(-wanted[req_id] // BLOCK_SIZE)
        _check_invariants(bm, req_ids)
    for r in req_ids:
        bm.free(r)
    assert bm.num_free_blocks == NUM_BLOCKS


def _hashes(tokens: list[int]) -> list[bytes]:
    return extend_block_hashes([], tokens, len(tokens), BLOCK_SIZE)


def test_cached_blocks_are_found_shared_and_survive_their_holder():
    """Guards against: a freed block losing its content hash (no reuse after the first request
    finishes), a shared block returned to the free queue while a holder still uses it."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    tokens = list(range(10))  # two full blocks and a partial one
    a = bm.grow("a", 10)
    bm.cache("a", _hashes(tokens))
    assert bm.num_cached_blocks == 2
    hit = bm.find_cached(_hashes(tokens + [99]), max_blocks=8)
    assert hit == a[:2], "the longest cached chain of full blocks"
    bm.take_cached("b", hit)
    bm.free("a")
    assert set(hit).isdisjoint(bm._free), "b still holds the shared blocks"
    bm.free("b")
    assert bm.find_cached(_hashes(tokens), 8) == a[:2], "free blocks keep their hash until evicted"
    bm.check_invariants()


def test_a_changed_token_or_extra_key_misses_and_eviction_forgets():
    bm = BlockManager(4, BLOCK_SIZE)
    tokens = list(range(8))
    bm.grow("a", 8)
    bm.cache("a", _hashes(tokens))
    other = tokens[:3] + [77] + tokens[4:]
    assert bm.find_cached(_hashes(other), 8) == [], "the first block differs: the chain breaks at once"
    keyed = extend_block_hashes([], tokens, 8, BLOCK_SIZE, [(4, 8, "image-1")])
    assert len(bm.find_cached(keyed, 8)) == 1, "an extra key over the second block changes only it"
    bm.free("a")
    bm.grow("b", 16)  # takes every block: the cached ones are evicted
    assert bm.find_cached(_hashes(tokens), 8) == [] and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_max_blocks_leaves_tokens_to_compute_and_can_grow_counts_free_hits():
    bm = BlockManager(3, BLOCK_SIZE)
    tokens = list(range(8))
    bm.grow("a", 8)
    bm.cache("a", _hashes(tokens))
    bm.free("a")  # both cached blocks now sit in the free queue
    assert bm.find_cached(_hashes(tokens), max_blocks=1) == bm.find_cached(_hashes(tokens), 8)[:1]
    hit = bm.find_cached(_hashes(tokens), 8)
    assert bm.can_grow("b", 12, hit), "two hits from the free queue + one new block = all three"
    assert not bm.can_grow("b", 16, hit)


_cache_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free", "reset"]), st.integers(0, 4), st.integers(1, 4 * BLOCK_SIZE)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_cache_ops)
def test_random_admit_grow_free_with_the_prefix_cache(ops: list[tuple[str, int, int]]) -> None:
    """Random admit (with cache hits) / grow / finish / reset sequences over requests drawn from
    a few shared prefixes: no leaked or doubly freed block, refcounts match the holders, and a
    cached block's content never changes while it is cached (a grow never hands out a block
    that another request can still find or holds)."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    prefixes = [[p] * 3 * BLOCK_SIZE for p in range(3)]
    live: dict[str, list[int]] = {}  # request -> its tokens
    content: dict[int, tuple[int, ...]] = {}  # block -> the tokens written into it
    n = 0
    for op, which, length in ops:
        if op == "admit":
            rid, n = f"r{n}", n + 1
            tokens = prefixes[which % 3][:length] + [1000 + n]
            hit = bm.find_cached(_hashes(tokens), (len(tokens) - 1) // BLOCK_SIZE)
            if not bm.can_grow(rid, len(tokens), hit):
                continue
            for b in hit:
                assert content[b] == tuple(tokens[hit.index(b) * BLOCK_SIZE :][:BLOCK_SIZE]), "a hit with other content"
            bm.take_cached(rid, hit)
            new = bm.grow(rid, len(tokens))
            for i, b in enumerate(bm.block_ids(rid)):
                if b in new:
                    content[b] = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            bm.cache(rid, _hashes(tokens))
            live[rid] = tokens
        elif op == "grow" and live:  # a running request appends tokens (decode, next chunk)
            rid = sorted(live)[which % len(live)]
            tokens = live[rid] + [2000 + n + k for k in range(length)]
            n += 1
            if not bm.can_grow(rid, len(tokens)):
                continue
            new = bm.grow(rid, len(tokens))
            for i, b in enumerate(bm.block_ids(rid)):
                if b in new:
                    content[b] = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                elif i * BLOCK_SIZE < len(tokens) and len(content[b]) < BLOCK_SIZE:  # its partial last block fills up
                    content[b] = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            bm.cache(rid, _hashes(tokens))
            live[rid] = tokens
        elif op == "free" and live:
            rid = sorted(live)[which % len(live)]
            bm.free(rid)
            del live[rid]
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
    for rid in list(live):
        bm.free(rid)
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants()
