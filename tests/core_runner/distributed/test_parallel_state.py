"""Leaving the tensor-parallel group drops the group object's process-group handles.

Guards against: handles kept past `destroy_tensor_parallel`, which keep gloo's worker threads
running until the interpreter shuts down (where a rank aborted at exit now and then), including
when the group was left before the engine closed (`cleanup_dist_env_and_memory` first).
The two-rank path is covered end to end by tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import torch.distributed as dist

from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, destroy_tensor_parallel


def test_closing_after_the_group_was_left_still_drops_the_handles():
    assert not dist.is_initialized()
    handle = object()  # stands for a ProcessGroup: only whether it is still held matters
    tp = TensorParallelGroup(rank=0, world_size=2, device_group=handle, cpu_group=handle)
    destroy_tensor_parallel(wait_for_others=False, tp=tp)
    assert tp.device_group is None and tp.cpu_group is None
    assert (tp.rank, tp.world_size) == (0, 2)


def test_release_drops_both_handles_of_the_shared_object():
    tp = TensorParallelGroup(rank=1, world_size=2, device_group=object(), cpu_group=object())
    layers_view = tp  # every sharded layer holds this same object
    tp.release()
    assert layers_view.device_group is None and layers_view.cpu_group is None
