"""BlockManager: hands out KV-cache block ids to requests from one shared free list."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Owns which KV-cache block belongs to which request; the runner only sees the ids.

    A request holds `ceil(num_tokens / block_size)` blocks for the tokens it has in (or is
    about to write to) the KV cache. The scheduler grows a request before each step that
    extends it and frees all of its blocks when it finishes, is aborted or is preempted.

    The free list is a FIFO: freed blocks go to the back and allocation takes from the front,
    so the least recently freed block is reused first. Prefix caching will keep that order
    (it becomes the eviction order) and add a reference count and a content hash per block;
    nothing here assumes a block has exactly one owner beyond `_req_blocks`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # req_id -> block ids in sequence order: block i holds tokens [i*block_size, (i+1)*block_size).
        self._req_blocks: dict[str, list[int]] = {}
        # Holders per block in use. Parallel samples of one prompt share its full blocks
        # (`fork`); a block returns to the free list when its last holder frees it.
        self._ref_count: dict[int, int] = {}
        # Blocks a forked child must still copy from: held until the runner has copied them
        # (the parent may finish and free them meanwhile).
        self._pins: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks `req_id` needs so that it holds room for `num_tokens` tokens (0 if it has them)."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(self._req_blocks.get(req_id, ())))

    def can_grow(self, req_id: str, num_tokens: int) -> bool:
        return self.num_blocks_to_grow(req_id, num_tokens) <= len(self._free)

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
        new_ids = [self._free.popleft() for _ in range(num_new)]
        for block in new_ids:
            self._ref_count[block] = 1
        self._req_blocks.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def can_fork(self, num_tokens: int) -> bool:
        return (num_tokens % self.block_size == 0) or bool(self._free)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Give `child_id` the parent's first `num_tokens` tokens of KV cache without recompute.

        Full blocks are shared (reference counted, never written again: both sides only append
        past them). A partly filled last block is copied into a fresh block, since both will
        append into it. Returns the child's block ids and the (src, dst) block copies the runner
        must perform before the child's first step. Callers check `can_fork` first.
        """
        assert child_id not in self._req_blocks, f"request {child_id!r} already holds blocks"
        parent = self._req_blocks[parent_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        assert len(parent) >= num_full + (partial > 0), f"{parent_id!r} holds fewer than {num_tokens} tokens"
        shared = parent[:num_full]
        for block in shared:
            self._ref_count[block] += 1
        copies: list[tuple[int, int]] = []
        blocks = list(shared)
        if partial:
            assert self._free, "fork needs a free block for the partial last block; call can_fork() first"
            src, dst = parent[num_full], self._free.popleft()
            self._ref_count[dst] = 1
            self._ref_count[src] += 1  # pinned until release_pins: the copy happens on admission
            self._pins[child_id] = [src]
            copies.append((src, dst))
            blocks.append(dst)
        self._req_blocks[child_id] = blocks
        return list(blocks), copies

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the blocks `req_id` holds, in sequence order ([] if it holds none)."""
        return list(self._req_blocks.get(req_id, ()))

    def free(self, req_id: str) -> None:
        """Return every block of `req_id` to the free list.

        Freeing a request that holds no blocks (never grown, or already freed) is a no-op:
        an aborted waiting request or a request preempted before its first block both hold
        none, and the scheduler frees them through the same path. Because the entry is popped,
        a double free can never put a block on the free list twice.
        """
        self.release_pins(req_id)
        for block in self._req_blocks.pop(req_id, ()):
            self._unref(block)

    def release_pins(self, req_id: str) -> None:
        """The runner has made (or will make before any other write this step) the block copies
        of `req_id`'s fork: its source blocks need not be held any more."""
        for block in self._pins.pop(req_id, ()):
            self._unref(block)

    def _unref(self, block: int) -> None:
        self._ref_count[block] -= 1
        if self._ref_count[block] == 0:
            del self._ref_count[block]
            self._free.append(block)

    def has_blocks(self, req_id: str) -> bool:
        return req_id in self._req_blocks
