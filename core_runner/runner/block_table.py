"""BlockTables: each slot's KV-cache block ids, persistent across steps, gathered per step."""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = device
        self.table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)  # [slots, max_blocks]
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [slots]
        self.table = torch.zeros(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device)
        self._dirty: set[int] = set()

    def reset(self, slot: int, block_ids: list[int]) -> None:
        self.num_blocks_np[slot] = 0
        self.append(slot, block_ids)

    def append(self, slot: int, block_ids: list[int]) -> None:
        """Stage new blocks for `slot`; they reach the device table in `commit()`."""
        if not block_ids:
            return
        start = int(self.num_blocks_np[slot])
        end = start + len(block_ids)
        assert end <= self.max_num_blocks_per_req, f"slot {slot}: {end} blocks exceed max_num_blocks_per_req"
        self.table_np[slot, start:end] = block_ids
        self.num_blocks_np[slot] = end
        self._dirty.add(slot)

    def commit(self) -> None:
        """Copy the staged rows to the device table: one copy per step, only of changed rows."""
        if not self._dirty:
            return
        rows = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        if self.table.device.type == "cpu":
            self.table.numpy()[rows] = self.table_np[rows]
        else:  # index_copy_: unlike indexed assignment it never waits for the device
            rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
            self.table.index_copy_(0, rows_t, torch.from_numpy(self.table_np[rows]).to(self.device, non_blocking=True))

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
