"""BlockManager: block accounting under grow/free."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_fork_shares_full_blocks_copies_the_partial_one_and_pins_its_source():
    """Guards against: a shared block returned to the free list while a sibling still uses it,
    and the copy source reused by another request before the child's copy is made."""
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.grow("p", 10)  # blocks for tokens 0..9: two full, one partial
    child_blocks, copies = bm.fork("p", "c", 10)
    assert child_blocks[:2] == parent[:2] and child_blocks[2] not in parent
    assert copies == [(parent[2], child_blocks[2])]
    bm.free("p")  # the parent finishes before the child is admitted
    assert parent[2] not in list(bm._free), "the copy source is pinned until release_pins"
    assert set(parent[:2]).isdisjoint(bm._free), "full blocks are still the child's"
    bm.release_pins("c")
    assert parent[2] in bm._free
    bm.free("c")
    assert bm.num_free_blocks == 8


def test_fork_on_a_block_boundary_shares_everything():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = bm.grow("p", 8)
    blocks, copies = bm.fork("p", "c", 8)
    assert blocks == parent and copies == []
    assert bm.num_free_blocks == 2
    bm.free("c")
    bm.free("p")
    assert bm.num_free_blocks == 4
