"""BlockTables: staged rows reach the device tables, and on a GPU without waiting for the stream.

Guards against: a committed row landing in another slot or group, a row of one step's commit
lost or overwritten by the next, and the commit blocking the host behind the kernels queued
before it (its copies come from pageable memory, which the CUDA driver may stage by waiting
for the stream; measured on one H100 it does not: under async scheduling the host would
otherwise stop overlapping the step in flight).
"""

from __future__ import annotations

import random

import pytest
import torch

from slotrunner.core_runner.runner.block_table import BlockTables


def _random_steps(tables: BlockTables, seed: int, steps: int = 40) -> None:
    """Resets and appends in random slots, a commit after each step; every step the device
    tables must equal the host's."""
    rng = random.Random(seed)
    num_slots, width, groups = tables.tables.shape[1], tables.max_num_blocks_per_req, tables.num_groups
    for _ in range(steps):
        for slot in rng.sample(range(num_slots), rng.randint(0, num_slots)):
            have = int(tables.num_blocks_np[slot])
            if have == width or rng.random() < 0.2:
                n = rng.randint(1, width)
                tables.reset(slot, [[rng.randrange(1000) for _ in range(n)] for _ in range(groups)])
            else:
                n = rng.randint(1, width - have)
                tables.append(slot, [[rng.randrange(1000) for _ in range(n)] for _ in range(groups)])
        tables.commit()
        assert torch.equal(tables.tables.cpu(), torch.from_numpy(tables.tables_np))


@pytest.mark.parametrize("groups", [1, 3])
def test_committed_rows_equal_the_host_tables(groups):
    _random_steps(BlockTables(6, 8, 4, torch.device("cpu"), num_groups=groups), seed=groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("groups", [1, 3])
def test_gpu_commit_equals_the_host_tables_and_does_not_wait(groups):
    tables = BlockTables(6, 8, 4, torch.device("cuda"), num_groups=groups)
    _random_steps(tables, seed=groups)
    if tables.num_blocks_np[0] < 8:
        tables.append(0, [[7] for _ in range(groups)])
    else:
        tables.reset(0, [[7] for _ in range(groups)])
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the commit's copy
    tables.commit()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "commit() waited for the kernels queued before it"
    assert torch.equal(tables.tables.cpu(), torch.from_numpy(tables.tables_np))
