"""BlockManager: block accounting under grow/free, the prefix cache, and KV-cache groups whose
sliding-window blocks leave once the window has passed them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotrunner.core_runner.engine.block_hash import extend_block_hashes
from slotrunner.core_runner.engine.block_manager import NULL_BLOCK, BlockManager

NUM_BLOCKS = 16
BLOCK_SIZE = 4


def _check_invariants(bm: BlockManager, req_ids: list[str]) -> None:
    held = [b for r in req_ids for b in bm.held_block_ids(r)]
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
    [first] = bm.grow("a", 5)  # 2 blocks
    assert len(first) == 2
    assert bm.grow("a", 8) == [[]]  # still fits in 2 blocks
    [third] = bm.grow("a", 9)
    assert len(third) == 1 and third[0] not in first
    assert bm.block_ids("a") == [first + third]
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
    assert bm.num_free_blocks == 1 and bm.block_ids("b") == [[]]


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
                [new] = bm.grow(req_id, target)
                [ids] = bm.block_ids(req_id)
                assert ids[len(ids) - len(new) :] == new
                wanted[req_id] = target
            else:
                with pytest.raises(AssertionError):
                    bm.grow(req_id, target)
        else:
            bm.free(req_id)
            wanted[req_id] = 0
        assert len(bm.block_ids(req_id)[0]) == -(-wanted[req_id] // BLOCK_SIZE)
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
    [a] = bm.grow("a", 10)
    bm.cache("a", _hashes(tokens))
    assert bm.num_cached_blocks == 2
    hit = bm.find_cached(_hashes(tokens + [99]), max_blocks=8)
    assert hit.num_blocks == 2 and hit.blocks == (a[:2],), "the longest cached chain of full blocks"
    bm.take_cached("b", hit)
    bm.free("a")
    assert set(a[:2]).isdisjoint(bm._free), "b still holds the shared blocks"
    bm.free("b")
    assert bm.find_cached(_hashes(tokens), 8).blocks == (a[:2],), "free blocks keep their hash until evicted"
    bm.check_invariants()


def test_a_changed_token_or_extra_key_misses_and_eviction_forgets():
    bm = BlockManager(4, BLOCK_SIZE)
    tokens = list(range(8))
    bm.grow("a", 8)
    bm.cache("a", _hashes(tokens))
    other = tokens[:3] + [77] + tokens[4:]
    assert bm.find_cached(_hashes(other), 8).num_blocks == 0, "the first block differs: the chain breaks at once"
    keyed = extend_block_hashes([], tokens, 8, BLOCK_SIZE, [(4, 8, "image-1")])
    assert bm.find_cached(keyed, 8).num_blocks == 1, "an extra key over the second block changes only it"
    bm.free("a")
    bm.grow("b", 16)  # takes every block: the cached ones are evicted
    assert bm.find_cached(_hashes(tokens), 8).num_blocks == 0 and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_max_blocks_leaves_tokens_to_compute_and_can_grow_counts_free_hits():
    bm = BlockManager(3, BLOCK_SIZE)
    tokens = list(range(8))
    bm.grow("a", 8)
    bm.cache("a", _hashes(tokens))
    bm.free("a")  # both cached blocks now sit in the free queue
    assert bm.find_cached(_hashes(tokens), max_blocks=1).blocks[0] == bm.find_cached(_hashes(tokens), 8).blocks[0][:1]
    hit = bm.find_cached(_hashes(tokens), 8)
    assert bm.can_grow("b", 12, hit), "two hits from the free queue + one new block = all three"
    assert not bm.can_grow("b", 16, hit)


# Groups of the random tests: one full-attention group (the plain cache), full attention with a
# sliding window of 6 (Gemma-like; 6 is not a multiple of BLOCK_SIZE), a window alone (Mistral),
# and two sliding groups beside one full group (vLLM's layer groups of one window).
WINDOWS = [(None,), (None, 6), (6,), (None, 9, 9)]

_cache_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "advance", "free", "reset"]), st.integers(0, 4), st.integers(1, 4 * BLOCK_SIZE)
    ),
    max_size=60,
)


def _record(bm: BlockManager, rid: str, tokens: list[int], new: list[list[int]], content: dict[int, tuple[int, ...]]) -> None:
    """Write `tokens` into the blocks `rid` holds: the new ones, and a partial last block that fills up."""
    for g, lst in enumerate(bm.block_ids(rid)):
        for i, b in enumerate(lst):
            if b == NULL_BLOCK and bm.windows[g] is not None:
                continue
            if b in new[g] or (i * BLOCK_SIZE < len(tokens) and len(content[b]) < BLOCK_SIZE):
                content[b] = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])


@pytest.mark.parametrize("windows", WINDOWS)
@settings(max_examples=80, deadline=None)
@given(ops=_cache_ops)
def test_random_admit_grow_free_with_the_prefix_cache(windows: tuple[int | None, ...], ops: list[tuple[str, int, int]]) -> None:
    """Random admit (with cache hits) / grow / advance past the window / finish / reset
    sequences over requests drawn from a few shared prefixes, for each kind of KV-cache groups:
    no leaked or doubly freed block, refcounts match the holders, NULL_BLOCK never handed out, a
    sliding-window group holds no block its window has passed, and a cached block's content
    never changes while it is cached (a grow never hands out a block that another request can
    still find or holds) -- also for the window blocks a hit takes without the blocks before."""
    num_blocks = NUM_BLOCKS * len(windows) + 1
    bm = BlockManager(num_blocks, BLOCK_SIZE, windows)
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
            for blocks, start in zip(hit.blocks, hit.starts):
                assert len(blocks) == hit.num_blocks - start
                for i, b in enumerate(blocks, start=start):
                    assert content[b] == tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), "a hit with other content"
            bm.take_cached(rid, hit)
            _record(bm, rid, tokens, bm.grow(rid, len(tokens)), content)
            bm.cache(rid, _hashes(tokens))
            live[rid] = tokens
        elif op == "grow" and live:  # a running request appends tokens (decode, next chunk)
            rid = sorted(live)[which % len(live)]
            tokens = live[rid] + [2000 + n + k for k in range(length)]
            n += 1
            if not bm.can_grow(rid, len(tokens)):
                continue
            _record(bm, rid, tokens, bm.grow(rid, len(tokens)), content)
            bm.cache(rid, _hashes(tokens))
            live[rid] = tokens
        elif op == "advance" and live:  # every token computed: the next step reads from its end
            rid = sorted(live)[which % len(live)]
            bm.free_outside_window(rid, len(live[rid]))
            for g, window in enumerate(windows):
                held = [b for b in bm.block_ids(rid)[g] if b != NULL_BLOCK] if window else []
                assert window is None or len(held) <= -(-window // BLOCK_SIZE) + 1, f"group {g} holds {len(held)} blocks"
        elif op == "free" and live:
            rid = sorted(live)[which % len(live)]
            bm.free(rid)
            del live[rid]
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
    for rid in list(live):
        bm.free(rid)
    assert bm.num_free_blocks == bm.num_blocks == num_blocks - (1 if any(windows) else 0)
    bm.check_invariants()


@pytest.mark.parametrize("windows", WINDOWS)
def test_caching_one_block_at_a_time_equals_caching_the_range(windows):
    """`cache_block` (a decode row that filled a block) registers exactly what `cache` of that
    block's range does, in every group that holds it: two managers take the same random
    requests, decode growth, window frees and finishes, one registering each filled block
    alone; their caches must stay equal. Other requests' prompts repeat earlier outputs, so
    blocks registered either way are hit."""
    import random

    rng = random.Random(len(windows))
    twins = [BlockManager(NUM_BLOCKS * len(windows) + 1, BLOCK_SIZE, windows) for _ in range(2)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.choice(["admit", "decode", "decode", "decode", "free"])
        if op == "admit" or not live:
            rid = f"r{step}"
            donor = live.get(rng.choice(sorted(live))) if live and rng.random() < 0.7 else None
            tokens = (donor[: rng.randint(1, len(donor))] if donor else []) + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            hashes = _hashes(tokens)
            hits = [bm.find_cached(hashes, (len(tokens) - 1) // BLOCK_SIZE) for bm in twins]
            assert hits[0] == hits[1]
            if not twins[0].can_grow(rid, len(tokens), hits[0]):
                continue
            for bm, hit in zip(twins, hits):
                bm.take_cached(rid, hit)
                bm.grow(rid, len(tokens))
                bm.cache(rid, hashes)
            live[rid] = tokens
        elif op == "decode":
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randrange(5)]
            if not twins[0].can_grow(rid, len(tokens)):
                continue
            for bm in twins:
                bm.free_outside_window(rid, len(live[rid]))
                bm.grow(rid, len(tokens))
            if len(tokens) % BLOCK_SIZE == 0:  # it filled block i
                i, hashes = len(tokens) // BLOCK_SIZE - 1, _hashes(tokens)
                twins[0].cache(rid, hashes, i, i + 1)
                twins[1].cache_block(rid, i, hashes[i])
            live[rid] = tokens
        else:
            rid = rng.choice(sorted(live))
            for bm in twins:
                bm.free(rid)
            del live[rid]
        assert twins[0]._hash_of == twins[1]._hash_of and twins[0]._block_of == twins[1]._block_of, f"step {step}"
    assert any(twins[0]._block_of), "nothing was cached"


def test_sliding_window_blocks_leave_exactly_when_no_query_sees_them():
    """Guards against an off-by-one in the window: a query at p reads keys p - W < k <= p, so with
    `num_computed` tokens done the first key still read is num_computed - W + 1. Freeing the block
    holding that key corrupts attention; keeping the one before it wastes a block per request."""
    window = 8
    bm = BlockManager(32, BLOCK_SIZE, (None, window))
    bm.grow("a", 40)  # 10 blocks in each group
    full, sliding = bm.block_ids("a")
    assert bm.free_outside_window("a", 38) == 7, "key 31 (block 7) is still read by the query at 38"
    assert bm.free_outside_window("a", 39) == 1, "the query at 39 reads from key 32: block 7 leaves"
    assert bm.block_ids("a") == [full, [NULL_BLOCK] * 8 + sliding[8:]], "full attention keeps every block"
    assert bm.free_outside_window("a", 39) == 0, "freeing twice frees nothing"
    assert bm.num_free_blocks == bm.num_blocks - 12
    bm.free("a")
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_a_long_request_holds_a_window_of_blocks_and_growth_counts_each_group():
    """Guards against a sliding-window group that holds a long request's whole length (no memory
    saved) and against growth that counts one group only: decoding to 200 tokens holds 50 full
    blocks but only ceil(W / block_size) + 1 sliding ones, and each step's growth needs a block
    in both groups when it crosses a block boundary."""
    window = 6
    bm = BlockManager(1 + 50 + 3, BLOCK_SIZE, (None, window))
    bm.grow("a", 1)
    for num_computed in range(1, 200):  # decode: each step computes token num_computed
        bm.free_outside_window("a", num_computed)
        crossing = num_computed % BLOCK_SIZE == 0
        assert bm.num_blocks_to_grow("a", num_computed + 1) == (2 if crossing else 0)
        assert bm.can_grow("a", num_computed + 1)
        bm.grow("a", num_computed + 1)
        bm.check_invariants()
    full, sliding = bm.block_ids("a")
    assert len(full) == len(sliding) == 50
    assert len([b for b in sliding if b != NULL_BLOCK]) <= -(-window // BLOCK_SIZE) + 1
    assert not bm.can_grow("b", 2 * BLOCK_SIZE), "what is left does not give a second request two blocks per group"


def test_a_sliding_window_hit_needs_only_the_blocks_its_window_reads():
    """Guards against (a) a hit that takes blocks before the window (they would be freed at once,
    and a cache of one request's worth could never re-admit it), (b) a hit whose window blocks
    were evicted (the next query would read overwritten keys)."""
    window = 6
    bm = BlockManager(1 + 2 * 6, BLOCK_SIZE, (None, window))
    tokens = list(range(5 * BLOCK_SIZE + 1))
    bm.grow("a", len(tokens))
    bm.cache("a", _hashes(tokens))
    bm.free_outside_window("a", 5 * BLOCK_SIZE)  # window from key 15: sliding blocks 0..2 leave
    hit = bm.find_cached(_hashes(tokens), 5)
    assert hit.num_blocks == 5 and hit.starts == (0, 3), "sliding blocks 3 and 4 cover the next query's window"
    assert bm.can_grow("b", len(tokens), hit)
    bm.take_cached("b", hit)
    assert bm.block_ids("b")[1][:3] == [NULL_BLOCK] * 3
    bm.free("a")
    bm.free("b")
    # Evict sliding block 4 (and only blocks not in the chain before it): the longest hit whose
    # window is cached is then shorter.
    sliding_4 = hit.blocks[1][-1]
    while sliding_4 in bm._free:
        bm.grow(f"x{len(bm._req_blocks)}", 1)
    shorter = bm.find_cached(_hashes(tokens), 5)
    assert shorter.num_blocks < 5 and sliding_4 not in shorter.blocks[1]
    for blocks, start in zip(shorter.blocks, shorter.starts):
        assert len(blocks) == shorter.num_blocks - start
    bm.check_invariants()


@pytest.mark.parametrize("windows", [(None,), (None, 6)], ids=["one group", "full + sliding"])
def test_room_is_what_the_blocks_hold(windows):
    """Guards against the scheduler's growth check (`room`: tokens a request's blocks hold) and
    the blocks disagreeing: a decode row that passes the last block's end must grow (else its
    KV goes nowhere), one that does not must not (a block lost per step). Steps of several
    tokens (drafts) may pass one boundary or two, or end exactly on one."""
    first = 1 if len(windows) > 1 else 0
    bm = BlockManager(first + 40, BLOCK_SIZE, windows)
    assert bm.room.get("a", 0) == 0 and bm.num_blocks_to_grow("a", 1) == len(windows)
    num_tokens = 0
    for step in (1, BLOCK_SIZE - 1, 1, 1, BLOCK_SIZE + 3, 2 * BLOCK_SIZE, 1, BLOCK_SIZE - 1):
        num_tokens += step
        bm.free_outside_window("a", num_tokens - step)
        passes = num_tokens > bm.room.get("a", 0)
        assert (bm.num_blocks_to_grow("a", num_tokens) > 0) == passes
        new = bm.grow("a", num_tokens)
        assert any(new) == passes
        assert bm.room["a"] == -(-num_tokens // BLOCK_SIZE) * BLOCK_SIZE
        bm.check_invariants()
    bm.free("a")
    assert "a" not in bm.room
    bm.check_invariants()


def test_room_of_a_cached_prefix():
    """A request that starts from cached blocks has room for exactly those blocks' tokens."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    tokens = list(range(3 * BLOCK_SIZE))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, len(tokens), BLOCK_SIZE)
    bm.grow("a", len(tokens))
    bm.cache("a", hashes)
    cached = bm.find_cached(hashes, 2)
    bm.take_cached("b", cached)
    assert bm.room["b"] == 2 * BLOCK_SIZE and bm.num_blocks_to_grow("b", 2 * BLOCK_SIZE) == 0
    assert bm.num_blocks_to_grow("b", 2 * BLOCK_SIZE + 1) == 1
    bm.check_invariants()
