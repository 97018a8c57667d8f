"""The tensor-parallel group of this process: its rank, size, process groups and collectives.

A process joins one group per engine (`init_tensor_parallel`) and leaves it when the engine
closes (`destroy_tensor_parallel`). Two process groups serve it: `device_group` carries the
tensor collectives of the forward (NCCL on CUDA, gloo on CPU) with a finite timeout, so a rank
that stops answering fails the others instead of hanging them; `cpu_group` (always gloo)
carries the step broadcast from rank 0, with a long timeout because the other ranks wait on it
while the engine is idle (a rank that dies closes its sockets, so gloo fails at once anyway).

Layers learn the group while the model is built: the builder installs it with
`tensor_parallel_scope`, each layer keeps `current_tp()` in its constructor, and outside a scope
(every engine with tensor_parallel_size=1) `current_tp()` is `SINGLE`, for which every
collective is the identity.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A forward's collective that waits longer than this fails: a rank died or hangs.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# The other ranks wait this long for rank 0's next step (an idle engine sends none).
STEP_WAIT_TIMEOUT = timedelta(days=30)
_POLL_S = 0.05


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher (torchrun, or `LLM` spawning its workers) tells each process."""

    rank: int
    world_size: int
    local_rank: int  # the process's index on its node: its GPU
    master_addr: str
    master_port: int


def launch_env() -> LaunchEnv | None:
    """The launcher's environment variables (the one place they are read), or None when this
    process was not started by a launcher (no RANK / WORLD_SIZE)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    except ValueError as e:
        raise ValueError(f"RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers: {e}") from None


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device_group: Any = None  # ProcessGroup for tensor collectives; None when world_size == 1
    cpu_group: Any = None  # gloo ProcessGroup for the step broadcast; None when world_size == 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the engine (scheduler, sampling results); the others follow its steps."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows, world_size * n]
        """Every rank's `x`, concatenated along the last dimension in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int, check_peers: Callable[[], None] | None = None) -> int:
        """The smallest of the ranks' `value`s (KV blocks that fit on every rank). `check_peers`
        raises when a rank has died; it is polled while waiting, so a rank that failed to build
        fails this one instead of leaving it waiting out the timeout."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group, async_op=True)
        while not work.is_completed():
            if check_peers is not None:
                check_peers()
            time.sleep(_POLL_S)
        work.wait()
        return int(t.item())

    def broadcast_step(self, message: Any) -> Any:
        """Rank 0 sends `message` (one pickled object), every other rank returns it: one
        broadcast_object_list per step on the gloo group."""
        box = [message if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def release(self) -> None:
        """Drop the handles of the process groups this group has left (destroy_tensor_parallel).
        `destroy_process_group` unregisters them, but a handle still held keeps gloo's worker
        threads (six a rank on CPU) running until the interpreter shuts down and tears them down
        there, which is where a rank aborted at exit now and then ("terminate called without an
        active exception"). Without the handles they stop here, while Python still runs. A
        collective called afterwards fails: no process group is initialized."""
        object.__setattr__(self, "device_group", None)  # frozen: the layers share this one object
        object.__setattr__(self, "cpu_group", None)

    def leave_together(self) -> None:
        """After rank 0's stop message: wait until every rank has it before any leaves the
        group. A rank that tears its group down while another's last collective is still in
        flight can abort the process at exit (seen rarely with gloo: "terminate called without
        an active exception")."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


SINGLE = TensorParallelGroup(rank=0, world_size=1)

_scope: TensorParallelGroup | None = None


def current_tp() -> TensorParallelGroup:
    """The group the model being built shards for (`SINGLE` outside `tensor_parallel_scope`)."""
    return SINGLE if _scope is None else _scope


@contextmanager
def tensor_parallel_scope(tp: TensorParallelGroup) -> Iterator[None]:
    """Install `tp` for the layers constructed inside (one model build; no nesting)."""
    global _scope
    assert _scope is None, "tensor_parallel_scope does not nest: one model is built at a time"
    _scope = tp
    try:
        yield
    finally:
        _scope = None


def check_no_group() -> None:
    """ValueError when this process is in a process group already (one engine's group at a time)."""
    if dist.is_initialized():
        raise ValueError(
            "a torch.distributed process group already exists in this process: close the other tensor-parallel "
            "LLM (llm.close()) or call slotrunner.distributed.cleanup_dist_env_and_memory() first"
        )


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT
) -> TensorParallelGroup:
    """Join the group as `rank` (blocks until every rank has joined). NCCL where the device is
    CUDA, gloo otherwise; raises ValueError when NCCL is needed and missing."""
    check_no_group()
    backend = "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("tensor_parallel_size > 1 on CUDA needs NCCL, and this torch build has none")
        backend = "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=STEP_WAIT_TIMEOUT)
    if backend == "nccl":  # create the communicator now: a broken NCCL setup fails here, not in a step or a capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return TensorParallelGroup(rank, world_size, dist.group.WORLD, cpu_group)


LEAVE_WAIT = timedelta(seconds=10)  # rank 0's wait for the other ranks to leave (destroy_tensor_parallel)


def destroy_tensor_parallel(wait_for_others: bool = True, tp: TensorParallelGroup | None = None) -> None:
    """Leave the process group (if any); the process may join another afterwards. `tp`: this
    process's group object (the one its layers hold), whose process-group handles are dropped
    as soon as it has left (`TensorParallelGroup.release`).

    Rank 0 leaves last. It hosts the group's store (the env:// and tcp:// rendezvous of a
    torchrun-style launch), and a rank still tearing its groups down when that store went away
    aborted at exit now and then (gloo: "terminate called without an active exception"). So each
    other rank marks its departure in the store once it has left, and rank 0, when
    `wait_for_others` (it told them to leave and they heard), waits for those marks -- at most
    LEAVE_WAIT -- before it leaves."""

    def leave() -> None:
        if dist.is_initialized():  # not when left already (cleanup_dist_env_and_memory): only the handles then
            dist.destroy_process_group()
        if tp is not None:
            tp.release()

    if not dist.is_initialized():
        leave()
        return
    store = dist.distributed_c10d._get_default_store()  # kept alive past the groups by this reference
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        leave()
        try:
            store.set(f"slotrunner/left/{rank}", "1")
        except Exception:  # rank 0 gone already: nobody waits for the mark
            pass
        return
    if wait_for_others and world_size > 1:
        try:
            store.wait([f"slotrunner/left/{r}" for r in range(1, world_size)], LEAVE_WAIT)
        except Exception as e:  # a rank that died or hangs: leave without it
            logger.warning("tensor-parallel shutdown: not every rank left within %s: %s", LEAVE_WAIT, e)
    leave()
