"""BlockManager: KV-cache block ids for requests, and the prefix cache that keys full blocks by
their content so that a later request with the same prefix takes them instead of recomputing.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    """Owns which KV-cache block belongs to which request; the runner only sees the ids.

    A request holds `ceil(num_tokens / block_size)` blocks for the tokens it has in (or is
    about to write to) the KV cache. The scheduler grows a request before each step that
    extends it and frees all of its blocks when it finishes, is aborted or is preempted.

    Prefix cache: a full block can be registered under the hash of its content (`cache`: the
    chain of its prefix's token ids and the request's extra keys, `block_hash.py`). A block
    keeps its hash after its last holder frees it: it waits in the free queue, still findable
    (`find_cached`), until an allocation takes it (least recently freed first) and drops the
    hash. A block with a hash is never written again while anyone holds it: requests only
    append past their full blocks, so sharing needs no copy.

    Free queue order: blocks freed earlier are reused first; a request's blocks are freed tail
    first, so the head of a long shared prefix is the last to be evicted.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        # req_id -> block ids in sequence order: block i holds tokens [i*block_size, (i+1)*block_size).
        self._req_blocks: dict[str, list[int]] = {}
        self._ref_count: dict[int, int] = {}  # holders of each block in use
        self._hash_of: dict[int, bytes] = {}  # block -> its content hash (held or free)
        self._block_of: dict[bytes, int] = {}  # content hash -> the block that holds it
        self.num_cached_hits = 0  # blocks taken from the cache since start (stats, tests)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    # -- growth -----------------------------------------------------------------------------

    def num_blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks `req_id` needs so that it holds room for `num_tokens` tokens (0 if it has them)."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(self._req_blocks.get(req_id, ())))

    def can_grow(self, req_id: str, num_tokens: int, cached: list[int] | tuple[int, ...] = ()) -> bool:
        """Whether `req_id`, after taking the `cached` blocks (`find_cached`), can grow to hold
        `num_tokens` tokens. A cached block that sits in the free queue counts against it too."""
        taken_from_free = sum(1 for b in cached if b in self._free)
        new = max(0, -(-num_tokens // self.block_size) - len(self._req_blocks.get(req_id, ())) - len(cached))
        return new + taken_from_free <= len(self._free)

    def grow(self, req_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks so `req_id` holds room for `num_tokens` tokens; return only the new ids.

        Callers check `can_grow` first: running out here is a scheduler bug, hence an assert.
        Never shrinks a request (a smaller `num_tokens` returns []).
        """
        num_new = self.num_blocks_to_grow(req_id, num_tokens)
        if num_new == 0:
            return []
        assert num_new <= len(self._free), (
            f"request {req_id!r} needs {num_new} more blocks for {num_tokens} tokens but only "
            f"{len(self._free)} are free; call can_grow() before grow()"
        )
        new_ids = [self._take_free() for _ in range(num_new)]
        self._req_blocks.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:  # evicted: its content is about to be overwritten
            del self._block_of[old]
        self._ref_count[block] = 1
        return block

    # -- prefix cache ----------------------------------------------------------------------------

    def find_cached(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        """The blocks of the longest cached prefix of `block_hashes`, at most `max_blocks`."""
        blocks = []
        for h in block_hashes[:max_blocks]:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_cached(self, req_id: str, blocks: list[int]) -> None:
        """Give a request that holds nothing the cached `blocks` (`find_cached`) as its first ones."""
        assert req_id not in self._req_blocks, f"request {req_id!r} already holds blocks"
        for block in blocks:
            if block in self._free:
                del self._free[block]
                self._ref_count[block] = 1
            else:
                self._ref_count[block] += 1
        self._req_blocks[req_id] = list(blocks)
        self.num_cached_hits += len(blocks)

    def cache(self, req_id: str, block_hashes: list[bytes]) -> None:
        """Register the request's first `len(block_hashes)` blocks under these hashes. Called once
        their tokens are written by a step that ran or is about to run before any reader of
        them. A hash another block already holds keeps that block (two requests computed the
        same prefix at once); this one stays unregistered."""
        blocks = self._req_blocks.get(req_id, ())
        assert len(block_hashes) <= len(blocks), f"request {req_id!r} holds {len(blocks)} blocks, not {len(block_hashes)}"
        for block, h in zip(blocks, block_hashes):
            if block in self._hash_of or h in self._block_of:
                continue
            self._hash_of[block] = h
            self._block_of[h] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (held blocks stay with their requests; nothing will hit them)."""
        self._hash_of.clear()
        self._block_of.clear()

    # -- release ---------------------------------------------------------------------------------

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the blocks `req_id` holds, in sequence order ([] if it holds none)."""
        return list(self._req_blocks.get(req_id, ()))

    def free(self, req_id: str) -> None:
        """Drop every block reference of `req_id`; a block nobody holds joins the free queue.

        Freeing a request that holds no blocks (never grown, or already freed) is a no-op:
        an aborted waiting request or a request preempted before its first block both hold
        none, and the scheduler frees them through the same path. Because the entry is popped,
        a double free can never put a block on the free list twice.
        """
        for block in reversed(self._req_blocks.pop(req_id, ())):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                del self._ref_count[block]
                self._free[block] = None

    def has_blocks(self, req_id: str) -> bool:
        return req_id in self._req_blocks

    def check_invariants(self) -> None:
        """Every block is free xor held, refcounts match the holders, hashes map both ways (tests)."""
        holders: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        assert holders == self._ref_count, "refcounts do not match the requests' blocks"
        assert not set(holders) & set(self._free), "a held block is in the free queue"
        assert len(holders) + len(self._free) == self.num_blocks, "a block is neither held nor free"
        assert {b: h for h, b in self._block_of.items()} == self._hash_of, "the hash maps disagree"
