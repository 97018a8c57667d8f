"""BlockTables: each slot's KV-cache block ids, persistent across steps, gathered per step."""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    """One table per KV-cache group (core_runner/runner/kv_cache.py): row `slot` of table g lists
    the request's block ids of group g in sequence order. `table` / `table_np` are group 0's."""

    def __init__(
        self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device, num_groups: int = 1
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = device
        self.num_groups = num_groups
        shape = (num_groups, max_num_reqs, max_num_blocks_per_req)
        self.tables_np = np.zeros(shape, dtype=np.int32)  # [groups, slots, max_blocks]
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [slots], the same in every group
        self.tables = torch.zeros(shape, dtype=torch.int32, device=device)  # [groups, slots, max_blocks]
        self.table_np, self.table = self.tables_np[0], self.tables[0]
        self._dirty: set[int] = set()
        self._resets = 0  # bumped when a slot's table starts over (a new request in the slot)
        # The last shared_prefix_blocks answer: (rows' bytes, resets, limit, blocks).
        self._shared: tuple[bytes, int, int, int] | None = None

    def reset(self, slot: int, block_ids: list[list[int]]) -> None:
        self._resets += 1
        self.num_blocks_np[slot] = 0
        self.append(slot, block_ids)

    def append(self, slot: int, block_ids: list[list[int]]) -> None:
        """Stage each group's new blocks for `slot` (one list per group, all of one length);
        they reach the device tables in `commit()`."""
        assert len(block_ids) == self.num_groups, f"slot {slot}: {len(block_ids)} block lists for {self.num_groups} groups"
        num_new = len(block_ids[0])
        if not num_new:
            return
        start = int(self.num_blocks_np[slot])
        end = start + num_new
        assert end <= self.max_num_blocks_per_req, f"slot {slot}: {end} blocks exceed max_num_blocks_per_req"
        for g, ids in enumerate(block_ids):
            assert len(ids) == num_new, f"slot {slot}: group {g} grows by {len(ids)} blocks, group 0 by {num_new}"
            self.tables_np[g, slot, start:end] = ids
        self.num_blocks_np[slot] = end
        self._dirty.add(slot)

    def commit(self) -> None:
        """Copy the staged rows to the device tables: one copy per step, only of changed rows."""
        if not self._dirty:
            return
        rows = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        if self.tables.device.type == "cpu":
            self.tables.numpy()[:, rows] = self.tables_np[:, rows]
        else:  # index_copy_: unlike indexed assignment it never waits for the device
            rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
            staged = torch.from_numpy(self.tables_np[:, rows]).to(self.device, non_blocking=True)
            self.tables.index_copy_(1, rows_t, staged)

    def shared_prefix_blocks(self, slots_np: np.ndarray, limit: int) -> int:
        """How many leading blocks (at most `limit`) every slot of `slots_np` names alike in
        every group: the blocks of a prompt prefix that prefix caching shares among them."""
        if limit <= 0 or len(slots_np) < 2:
            return max(limit, 0) if len(slots_np) == 1 else 0
        # A slot's blocks never change below its length until the slot starts over (`reset`),
        # so for the same rows only the columns past the last answer's limit are new: a decode
        # step over the same batch checks none or a few, not rows x limit ids.
        key, start = slots_np.tobytes(), 0
        if self._shared is not None and self._shared[:2] == (key, self._resets):
            last_limit, last = self._shared[2:]
            if last < min(last_limit, limit):
                return last  # a column that differed still differs
            start = min(last, limit)
        rows = self.tables_np[:, slots_np, start:limit]  # [groups, rows, limit - start]
        same = (rows == rows[:, :1]).all(axis=(0, 1))  # [limit - start] column equal in every row
        blocks = limit if same.all() else start + int(np.argmin(same))
        self._shared = (key, self._resets, limit, blocks)
        return blocks

    def gather(self, idx_mapping: torch.Tensor) -> torch.Tensor:  # [num_reqs] -> [num_reqs, max_blocks]
        return self.table.index_select(0, idx_mapping)


def compute_slot_mapping(
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] gathered rows
    token_rows: torch.Tensor,  # [num_tokens] batch row of each token
    positions: torch.Tensor,  # [num_tokens]
    block_size: int,
) -> torch.Tensor:  # [num_tokens] int64 flat slot in the KV cache
    block_ids = block_tables[token_rows, positions // block_size].long()
    return block_ids * block_size + positions % block_size
