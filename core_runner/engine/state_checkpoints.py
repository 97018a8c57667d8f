"""StateCheckpoints: which cached prefixes also have a checkpoint of a family's recurrent state.

A family whose per-request state is not in KV blocks (recurrent layers' per-slot state:
`ModelState.checkpoints_state`) can start a request from a cached prefix only where that state
was saved as well. The runner copies a slot's whole state into an entry of the family's state
cache after a step whose chunk ends at a *checkpoint position*, keyed by the hash of the last
full block before it -- the key of that block in the prefix cache. This index lives beside the
block manager: the scheduler decides hits and saves, the runner only copies
(`SchedulerOutput.state_checkpoints`, `NewRequestData.state_checkpoint`). It holds as many
entries as the family allocated; the least recently used one is overwritten first.

Checkpoint positions of a request with `num_tokens` known tokens: every `interval` tokens, and
the last block boundary before its last token ((num_tokens - 1) // block_size full blocks: the
longest hit an identical prompt can take, since one token is always computed). A state exists
only at the end of a step's chunk, so the scheduler ends prefill chunks there (`next_position`).

An entry reserved while a step is scheduled is written by that step's forward. It is *pending*
until the next `end_step()`: a request admitted in the same step cannot read it (its restore
would run before the forward). From the next step on it is readable: device work runs in step
order, so a later step's restore reads it after it is written, with async scheduling too.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slotrunner.core_runner.engine.request import Request


class StateCheckpoints:
    def __init__(self, num_entries: int, interval: int, block_size: int) -> None:
        if num_entries < 1:
            raise ValueError(f"a state checkpoint index needs at least one entry, got {num_entries}")
        self.block_size = block_size
        # Whole blocks only: a checkpoint is keyed by the hash of the block it ends.
        self.interval = max(1, interval // block_size) * block_size
        self.num_entries = num_entries
        self._entry_of: OrderedDict[bytes, int] = OrderedDict()  # block hash -> entry; least recently used first
        self._free: list[int] = list(range(num_entries - 1, -1, -1))
        self._pending: set[bytes] = set()  # reserved by the step being scheduled

    def __len__(self) -> int:
        return len(self._entry_of)

    def next_position(self, num_computed: int, num_tokens: int) -> int | None:
        """The first checkpoint position after `num_computed` of a request with `num_tokens`
        known tokens, or None when none is left (the prefill is past its last full block)."""
        last = (num_tokens - 1) // self.block_size * self.block_size
        if num_computed >= last:
            return None
        return min((num_computed // self.interval + 1) * self.interval, last)

    def cut(self, start: int, num_new: int, num_tokens: int) -> int:
        """A chunk of `num_new` tokens from `start`, cut at the next checkpoint position of a
        request with `num_tokens` known tokens: a state exists only at the end of a chunk."""
        position = self.next_position(start, num_tokens)
        return num_new if position is None else min(num_new, position - start)

    def request_save(self, request: Request, start: int, num_new: int, saves: dict[str, int]) -> None:
        """Have the runner save `request`'s state after this step (`saves[req_id]`: an entry)
        when its chunk of `num_new` tokens from `start` ends at a checkpoint position; its
        blocks up to there must be hashed."""
        end = start + num_new
        if self.next_position(start, request.num_tokens) != end:
            return
        entry = self.reserve(request.block_hashes[end // self.block_size - 1])
        if entry is not None:
            saves[request.req_id] = entry

    def longest_hit(self, block_hashes: list[bytes], num_blocks: int) -> tuple[int, int | None, bool]:
        """Among the first `num_blocks` blocks (a cached chain), the longest prefix whose last
        block has a readable checkpoint: (its blocks, its entry or None, whether a longer one is
        being written by the step being scheduled)."""
        longer_pending = False
        for n in range(num_blocks, 0, -1):
            h = block_hashes[n - 1]
            if h in self._pending:
                longer_pending = True
            elif h in self._entry_of:
                self._entry_of.move_to_end(h)  # used: the last to be overwritten
                return n, self._entry_of[h], longer_pending
        return 0, None, longer_pending

    def reserve(self, block_hash: bytes) -> int | None:
        """An entry to save the state that ends at `block_hash` into, or None: the state is
        checkpointed already (another request got there first), or every entry is pending."""
        if block_hash in self._entry_of:
            return None
        if self._free:
            entry = self._free.pop()
        else:
            victim = next((h for h in self._entry_of if h not in self._pending), None)
            if victim is None:
                return None
            entry = self._entry_of.pop(victim)
        self._entry_of[block_hash] = entry
        self._pending.add(block_hash)
        return entry

    def end_step(self) -> None:
        """The step being scheduled is complete: what it reserved is readable from the next one."""
        self._pending.clear()

    def reset(self) -> None:
        """Forget every checkpoint (a failed step may not have written the ones it reserved)."""
        self._entry_of.clear()
        self._pending.clear()
        self._free = list(range(self.num_entries - 1, -1, -1))
