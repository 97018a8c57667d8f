"""BlockManager: KV-cache block ids for requests, one block list per KV-cache group, and the
prefix cache that keys full blocks by their content so that a later request with the same
prefix takes them instead of recomputing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from slotrunner.core_runner.runner.kv_cache import NULL_BLOCK  # where a sliding window holds no block


class CachedPrefix(NamedTuple):
    """A cache hit (`find_cached`): its first `num_blocks` blocks' worth of tokens are computed.
    Group g needs only its blocks from position `starts[g]` on (a sliding window's; 0 for full
    attention), `blocks[g]`."""

    num_blocks: int
    blocks: tuple[list[int], ...]
    starts: tuple[int, ...]


class BlockManager:
    """Owns which KV-cache block belongs to which request; the runner only sees the ids.

    KV-cache groups (`windows`, one entry per group: None for full attention, else the window W
    of its sliding-window layers; core_runner/runner/kv_cache.py groups the layers). A request
    has one block list per group, where block i holds tokens [i*block_size, (i+1)*block_size).
    A full-attention group holds `ceil(num_tokens / block_size)` blocks for the tokens the
    request has in (or is about to write to) the KV cache. A sliding-window group holds the same
    positions but gives back, as the request advances, every block its queries can no longer
    see (`free_outside_window`): a query at position p reads keys p - W < k <= p, so once
    `num_computed` tokens are computed, blocks wholly before `num_computed - W + 1` are freed and
    their positions in the list become NULL_BLOCK. A long request then holds about W /
    block_size + 1 blocks in that group. All groups take block ids from one pool. With a
    sliding-window group, block 0 is NULL_BLOCK, never handed out: `num_blocks` counts the rest.

    The scheduler grows a request before each step that extends it and frees all of its blocks
    when it finishes, is aborted or is preempted.

    Prefix cache: a full block can be registered under the hash of its content (`cache`: the
    chain of its prefix's token ids and the request's extra keys, `block_hash.py`), in each
    group. A block keeps its hash after its last holder frees it: it waits in the free queue,
    still findable (`find_cached`), until an allocation takes it (least recently freed first) and
    drops the hash. A block with a hash is never written again while anyone holds it: requests
    only append past their full blocks, so sharing needs no copy. A hit of k blocks needs, in a
    full-attention group, all k blocks cached, and in a sliding-window group only those the next
    query's window covers (vLLM's rule): since a block's hash chains everything before it, a
    cached window block proves the whole prefix equal.

    Free queue order: blocks freed earlier are reused first; a request's blocks are freed tail
    first, so the head of a long shared prefix is the last to be evicted.
    """

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None] = (None,)) -> None:
        windows = tuple(windows)
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must list each KV-cache group's sliding window (>= 1) or None, got {windows}")
        first = 1 if any(w is not None for w in windows) else 0  # NULL_BLOCK is reserved
        if num_blocks - first < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= {1 + first} and 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks - first  # blocks requests can hold
        self.block_size = block_size
        self.windows = windows
        self.has_windows = any(w is not None for w in windows)  # else free_outside_window has nothing to do
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))  # eviction order
        # req_id -> per group, block ids in sequence order (NULL_BLOCK before its first held one).
        self._req_blocks: dict[str, list[list[int]]] = {}
        self._first_held: dict[str, list[int]] = {}  # req_id -> per group, the first position it holds
        # req_id -> tokens its blocks have room for (every group's list has the same length):
        # the scheduler reads it for every running request every step, and grows only a request
        # whose next tokens pass it -- a decode row once every block_size steps.
        self.room: dict[str, int] = {}
        self._ref_count: dict[int, int] = {}  # holders of each block in use
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # block -> (its group, its content hash), held or free
        self._block_of: list[dict[bytes, int]] = [{} for _ in windows]  # per group: content hash -> block
        self.num_cached_hits = 0  # blocks taken from the cache since start (stats, tests)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(m) for m in self._block_of)

    def _no_blocks(self) -> list[list[int]]:
        return [[] for _ in self.windows]

    # -- growth -----------------------------------------------------------------------------

    def num_blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks `req_id` needs, over all groups, to hold room for `num_tokens` tokens."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - self.room.get(req_id, 0) // self.block_size) * self.num_groups

    def can_grow(self, req_id: str, num_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """Whether `req_id`, after taking the `cached` prefix (`find_cached`; a request that
        holds nothing), can grow to hold `num_tokens` tokens. A cached block that sits in the
        free queue counts against it too."""
        if cached is None or cached.num_blocks == 0:
            return self.num_blocks_to_grow(req_id, num_tokens) <= len(self._free)
        taken_from_free = sum(1 for blocks in cached.blocks for b in blocks if b in self._free)
        new = max(0, -(-num_tokens // self.block_size) - cached.num_blocks) * self.num_groups
        return new + taken_from_free <= len(self._free)

    def grow(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """Allocate blocks so `req_id` holds room for `num_tokens` tokens; return only the new
        ids, per group.

        Callers check `can_grow` first: running out here is a scheduler bug, hence an assert.
        Never shrinks a request (a smaller `num_tokens` returns empty lists).
        """
        new_ids = self.try_grow(req_id, num_tokens)
        assert new_ids is not None, (
            f"request {req_id!r} needs {self.num_blocks_to_grow(req_id, num_tokens)} more blocks for {num_tokens} "
            f"tokens but only {len(self._free)} are free; call can_grow() before grow()"
        )
        return new_ids

    def try_grow(self, req_id: str, num_tokens: int) -> list[list[int]] | None:
        """`grow`, or None (nothing taken) where the free blocks do not suffice: one call for
        what `can_grow` then `grow` check (a decode row crossing a block boundary, every step
        for ~1/16 of a batch's rows)."""
        needed = -(-num_tokens // self.block_size)
        num_new = needed - self.room.get(req_id, 0) // self.block_size
        if num_new <= 0:
            return self._no_blocks()
        if num_new * self.num_groups > len(self._free):
            return None
        lists = self._req_blocks.get(req_id)
        if lists is None:
            lists = self._req_blocks[req_id] = self._no_blocks()
            self._first_held[req_id] = [0] * self.num_groups
        take, new_ids = self._take_free, []
        for lst in lists:
            new = [take() for _ in range(needed - len(lst))]
            lst.extend(new)
            new_ids.append(new)
        self.room[req_id] = needed * self.block_size
        return new_ids

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:  # evicted: its content is about to be overwritten
            del self._block_of[old[0]][old[1]]
        self._ref_count[block] = 1
        return block

    def free_outside_window(self, req_id: str, num_computed: int) -> int:
        """Free the blocks of `req_id`'s sliding-window groups that no query from position
        `num_computed` on can see (those wholly before `num_computed - W + 1`). Called before
        a step that computes from `num_computed`; a later rollback (rejected drafts) never goes
        below it. Returns how many blocks it freed."""
        lists = self._req_blocks.get(req_id) if self.has_windows else None
        if lists is None:
            return 0
        freed = 0
        firsts = self._first_held[req_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            lst = lists[g]
            end = min(max(0, num_computed - window + 1) // self.block_size, len(lst))
            for i in range(firsts[g], end):
                self._release(lst[i])
                lst[i] = NULL_BLOCK
                freed += 1
            firsts[g] = max(firsts[g], end)
        return freed

    # -- prefix cache ----------------------------------------------------------------------------

    def _window_start(self, g: int, num_blocks: int) -> int:
        """The first block group g needs once `num_blocks` blocks of tokens are computed."""
        window = self.windows[g]
        return 0 if window is None else max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def find_cached(self, block_hashes: list[bytes], max_blocks: int) -> CachedPrefix:
        """The longest cached prefix of `block_hashes`, at most `max_blocks` blocks."""
        limit = min(len(block_hashes), max_blocks)
        for g, window in enumerate(self.windows):  # full attention: every block of the prefix
            if window is None:
                n = 0
                while n < limit and block_hashes[n] in self._block_of[g]:
                    n += 1
                limit = n
        # Sliding windows: the longest k <= limit whose window blocks are cached in each group.
        # run[g][i]: cached blocks in a row ending at position i.
        runs = []
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            run, count = [], 0
            for h in block_hashes[:limit]:
                count = count + 1 if h in self._block_of[g] else 0
                run.append(count)
            runs.append((g, run))
        k = limit
        while k > 0 and any(run[k - 1] < k - self._window_start(g, k) for g, run in runs):
            k -= 1
        starts = tuple(self._window_start(g, k) for g in range(self.num_groups))
        blocks = tuple([self._block_of[g][h] for h in block_hashes[s:k]] for g, s in enumerate(starts))
        return CachedPrefix(k, blocks, starts)

    def take_cached(self, req_id: str, cached: CachedPrefix) -> None:
        """Give a request that holds nothing the `cached` prefix (`find_cached`) as its first
        blocks; positions a sliding window no longer covers get NULL_BLOCK."""
        assert req_id not in self._req_blocks, f"request {req_id!r} already holds blocks"
        if cached.num_blocks == 0:
            return
        for blocks in cached.blocks:
            for block in blocks:
                if block in self._free:
                    del self._free[block]
                    self._ref_count[block] = 1
                else:
                    self._ref_count[block] += 1
        self._req_blocks[req_id] = [[NULL_BLOCK] * s + list(b) for s, b in zip(cached.starts, cached.blocks)]
        self._first_held[req_id] = list(cached.starts)
        self.room[req_id] = cached.num_blocks * self.block_size
        self.num_cached_hits += cached.num_blocks

    def cache(self, req_id: str, block_hashes: list[bytes], start: int = 0, stop: int | None = None) -> None:
        """Register the request's first `stop` blocks (default `len(block_hashes)`; those it
        still holds) under these hashes; blocks before `start` were registered by an earlier call. Called once
        their tokens are written by a step that ran or is about to run before any reader of
        them. A hash another block of the group already holds keeps that block (two requests
        computed the same prefix at once); this one stays unregistered."""
        stop = len(block_hashes) if stop is None else stop
        lists = self._req_blocks.get(req_id)
        if lists is None:
            assert not stop, f"request {req_id!r} holds no blocks, not {stop}"
            return
        for g, (lst, first) in enumerate(zip(lists, self._first_held[req_id])):
            assert stop <= len(lst), f"request {req_id!r} holds {len(lst)} blocks, not {stop}"
            lo = max(first, start)
            for block, h in zip(lst[lo:stop], block_hashes[lo:stop]):
                self._register(g, block, h)

    def cache_block(self, req_id: str, i: int, block_hash: bytes) -> None:
        """`cache` of the request's block i alone (a decode row that filled it), in every group
        that still holds it."""
        for g, (lst, first) in enumerate(zip(self._req_blocks[req_id], self._first_held[req_id])):
            if i >= first:
                self._register(g, lst[i], block_hash)

    def _register(self, g: int, block: int, block_hash: bytes) -> None:
        if block not in self._hash_of and block_hash not in self._block_of[g]:
            self._hash_of[block] = (g, block_hash)
            self._block_of[g][block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (held blocks stay with their requests; nothing will hit them)."""
        self._hash_of.clear()
        for m in self._block_of:
            m.clear()

    # -- release ---------------------------------------------------------------------------------

    def block_ids(self, req_id: str) -> list[list[int]]:
        """A copy of each group's block list of `req_id`, in sequence order (empty if it holds none)."""
        return [list(lst) for lst in self._req_blocks.get(req_id, self._no_blocks())]

    def _release(self, block: int) -> None:
        self._ref_count[block] -= 1
        if self._ref_count[block] == 0:
            del self._ref_count[block]
            self._free[block] = None

    def free(self, req_id: str) -> None:
        """Drop every block reference of `req_id`; a block nobody holds joins the free queue.

        Freeing a request that holds no blocks (never grown, or already freed) is a no-op:
        an aborted waiting request or a request preempted before its first block both hold
        none, and the scheduler frees them through the same path. Because the entry is popped,
        a double free can never put a block on the free list twice. Blocks go tail first,
        position by position across the groups.
        """
        lists = self._req_blocks.pop(req_id, None)
        if lists is None:
            return
        firsts = self._first_held.pop(req_id)
        del self.room[req_id]
        for i in range(max(len(lst) for lst in lists) - 1, -1, -1):
            for lst, first in zip(lists, firsts):
                if first <= i < len(lst):
                    self._release(lst[i])

    def has_blocks(self, req_id: str) -> bool:
        return req_id in self._req_blocks

    def held_block_ids(self, req_id: str) -> list[int]:
        """Every block `req_id` holds, over all groups (tests, stats)."""
        lists = self._req_blocks.get(req_id, ())
        return [b for lst, first in zip(lists, self._first_held.get(req_id, ())) for b in lst[first:]]

    def check_invariants(self) -> None:
        """Every block is free xor held, refcounts match the holders, hashes map both ways, no
        request holds NULL_BLOCK or a position out of its window (tests)."""
        holders: dict[int, int] = {}
        assert self.room.keys() == self._req_blocks.keys(), "room is kept for other requests than hold blocks"
        for req_id, lists in self._req_blocks.items():
            room = self.room[req_id]
            assert all(len(lst) * self.block_size == room for lst in lists), f"{req_id!r}: room disagrees with its blocks"
            for g, (lst, first) in enumerate(zip(lists, self._first_held[req_id])):
                assert all(b == NULL_BLOCK for b in lst[:first]), f"{req_id!r} group {g}: a freed position keeps a block"
                assert self.windows[g] is not None or first == 0, f"{req_id!r}: a full-attention group dropped blocks"
            for b in self.held_block_ids(req_id):
                holders[b] = holders.get(b, 0) + 1
        assert holders == self._ref_count, "refcounts do not match the requests' blocks"
        assert not set(holders) & set(self._free), "a held block is in the free queue"
        assert len(holders) + len(self._free) == self.num_blocks, "a block is neither held nor free"
        if any(w is not None for w in self.windows):
            assert NULL_BLOCK not in holders and NULL_BLOCK not in self._free, "NULL_BLOCK was handed out"
        inverse = {b: (g, h) for g, m in enumerate(self._block_of) for h, b in m.items()}
        assert inverse == self._hash_of, "the hash maps disagree"
