"""RecurrentStateCache: checkpoints of whole slots' recurrent state, the device half of prefix
caching for recurrent hybrids.

A prefix-cache hit hands a request the KV blocks of its prefix; a recurrent layer's state after
that prefix cannot be rebuilt from them. So while prompts are prefilled, the state of a slot
(every pool of `RecurrentHybridModelState`: conv windows, SSM / matrix states, every layer) is
copied into an entry of this cache at checkpoint positions, and a request admitted with a hit
gets the entry copied into its slot. Which entry holds which prefix (block hash, LRU) is decided
by the scheduler (`core_runner/engine/state_checkpoints.py`); this class only copies, on the
device, without a host sync.
"""

from __future__ import annotations

import torch


class RecurrentStateCache:
    def __init__(self, pools: list[torch.Tensor], num_entries: int) -> None:
        """`pools`: the ModelState's pools, each [layers, max_num_seqs + 1, *per-slot shape]."""
        self.num_entries = num_entries
        # Each [layers, num_entries, *per-slot shape], in the pools' order.
        self.entries = [torch.zeros((p.shape[0], num_entries, *p.shape[2:]), dtype=p.dtype, device=p.device) for p in pools]

    def save(self, pools: list[torch.Tensor], slots: list[int], entries: list[int]) -> None:
        """Copy the state of `slots` into `entries` (index for index), every pool at once."""
        device = pools[0].device
        src = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        dst = torch.tensor(entries, dtype=torch.int64).to(device, non_blocking=True)
        for pool, cache in zip(pools, self.entries, strict=True):
            cache.index_copy_(1, dst, pool.index_select(1, src))

    def restore(self, pools: list[torch.Tensor], slot: int, entry: int) -> None:
        """Overwrite the state of `slot` with checkpoint `entry`."""
        assert 0 <= entry < self.num_entries, f"state checkpoint {entry} out of range (the cache holds {self.num_entries})"
        for pool, cache in zip(pools, self.entries, strict=True):
            pool[:, slot].copy_(cache[:, entry])
