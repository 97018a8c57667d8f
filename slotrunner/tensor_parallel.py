"""Starting the ranks of a tensor-parallel engine, and stopping them.

Two ways in, one code path:

- spawned: `LLM(model, tensor_parallel_size=N)` in a process no launcher started. That process
  is rank 0; it starts ranks 1..N-1 (torch.multiprocessing, spawn) with a launcher's environment
  variables set, each of which builds the same engine and serves rank 0's steps.
- external launcher: `torchrun --nproc-per-node N script.py` (or any launcher setting RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) runs the same script on every rank. Rank 0's
  `LLM(...)` returns the engine; on the other ranks `LLM(...)` serves rank 0's steps until rank
  0 closes its LLM, then ends the process (SystemExit(0)): code after it runs on rank 0 only.
  Several nodes work the same way (MASTER_ADDR on rank 0's node).

Each rank runs on `cuda:LOCAL_RANK` when the engine's device is CUDA, on the CPU otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import signal
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from slotrunner.core_runner.distributed.parallel_state import (
    SINGLE,
    TensorParallelGroup,
    check_no_group,
    destroy_tensor_parallel,
    init_tensor_parallel,
    launch_env,
)
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.core_runner.runner.parallel_runner import TensorParallelRunner, serve_steps

_JOIN_TIMEOUT_S = 10.0  # how long close() waits for a worker to leave before terminating it


def check_tensor_parallel(model_cls: type, family: str, architecture: str, hf_config: Any, world_size: int) -> None:
    """ValueError naming the family when `model_cls` is not split over ranks, or when its heads
    do not divide; before any rank is started."""
    if world_size == 1:
        return
    check = getattr(model_cls, "check_tensor_parallel", None)
    if check is None:
        raise ValueError(
            f"tensor_parallel_size={world_size}: {architecture} ({family} family) does not run tensor-parallel yet "
            "(docs/architecture.md lists the architectures that do); use tensor_parallel_size=1"
        )
    check(hf_config, world_size)


@dataclass
class TensorParallelLaunch:
    """This process's part of a tensor-parallel engine: its group, and (rank 0 when it spawned
    them) the worker processes and the queue they report start-up errors on."""

    tp: TensorParallelGroup
    device: torch.device
    workers: list[Any] = field(default_factory=list)  # multiprocessing Process, rank i + 1
    errors: Any = None  # multiprocessing Queue of (rank, traceback text)
    runner: Any = None  # rank 0: its TensorParallelRunner, set once built
    cpu_threads: int | None = None  # torch's thread count before this rank took its share of the cores
    _closed: bool = False

    def check_peers(self) -> None:
        """RuntimeError naming the first spawned rank that has exited."""
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code {proc.exitcode}){self._error_of(rank)}")

    def _error_of(self, rank: int) -> str:
        try:
            while True:
                r, text = self.errors.get_nowait()
                if r == rank:
                    return f": {text.strip().splitlines()[-1]}"
        except (queue.Empty, AttributeError, OSError, ValueError):
            return ""

    def make_runner(self, config: Any, model: Any, model_state: Any, draft_model: Any = None) -> ModelRunner:
        """This rank's runner: rank 0 of several sends each step to the others first. A draft
        model (speculative decoding) runs with one rank only."""
        if self.tp.world_size == 1:
            return ModelRunner(config, model, model_state, draft_model)
        assert draft_model is None, "the engine builder refuses a draft model with tensor parallelism"
        if not self.tp.is_driver:
            return ModelRunner(config, model, model_state)
        check = self.check_peers if self.workers else None
        self.runner = TensorParallelRunner(config, model, model_state, self.tp, check)
        return self.runner

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group; idempotent, also run at exit."""
        if self._closed:
            return
        self._closed = True
        told = self.runner is not None and self.runner.shutdown()
        for proc in self.workers:
            proc.join(_JOIN_TIMEOUT_S if told else 0)
            if proc.is_alive():  # never told, or stuck in a collective: do not wait for it
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
        if self.tp.world_size > 1:  # joined (a launch that failed to join owns no group)
            destroy_tensor_parallel(wait_for_others=told, tp=self.tp)
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)


def join_tensor_parallel(args: Any, device: torch.device) -> TensorParallelLaunch:
    """Join (or start) the group of `args.tensor_parallel_size` ranks this engine (EngineArgs
    `args`) runs on; on rank 0 of a spawned group the others are started here."""
    world_size = args.tensor_parallel_size
    if world_size == 1:
        return TensorParallelLaunch(SINGLE, device)
    check_no_group()  # before starting any process
    env = launch_env()
    if env is not None:
        if env.world_size != world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} but the launcher started WORLD_SIZE={env.world_size} processes: "
                "start as many processes as tensor_parallel_size (one tensor-parallel group per launch)"
            )
        device = _rank_device(device, env.local_rank)
        init = f"tcp://{env.master_addr}:{env.master_port}"
        launch = TensorParallelLaunch(init_tensor_parallel(env.rank, world_size, init, device), device)
    else:
        launch = _spawn(args, device)
    atexit.register(launch.close)  # a script that never closes its LLM still stops the other ranks
    if device.type == "cpu":
        # The ranks share the CPU: each takes its share of torch's threads, or their threads
        # spin against each other and every collective waits for a descheduled peer.
        launch.cpu_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, launch.cpu_threads // world_size))
    return launch


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank on local GPU {local_rank}, but only {torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)


def _spawn(args: Any, device: torch.device) -> TensorParallelLaunch:
    world_size = args.tensor_parallel_size
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    errors = ctx.Queue()
    args = dataclasses.replace(args, device=device.type)  # each rank picks its own GPU
    workers = []
    for rank in range(1, world_size):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        proc = ctx.Process(target=_worker_main, args=(env, args, errors), daemon=True, name=f"slotrunner-tp{rank}")
        proc.start()
        workers.append(proc)
    device = _rank_device(device, 0)
    launch = TensorParallelLaunch(SINGLE, device, workers, errors)
    try:
        tp = _await_join(launch, world_size, f"tcp://127.0.0.1:{port}", device)
    except BaseException:
        launch.close()
        raise
    launch.tp = tp
    return launch


def _await_join(launch: TensorParallelLaunch, world_size: int, init: str, device: torch.device) -> TensorParallelGroup:
    """Rank 0 joins while watching the workers: one that dies before joining fails this at once."""
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["tp"] = init_tensor_parallel(0, world_size, init, device)
        except BaseException as e:  # handed to the waiting thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while thread.is_alive():
        launch.check_peers()
        thread.join(0.05)
    if "error" in result:
        raise result["error"]
    return result["tp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(env: dict[str, str], args: Any, errors: Any) -> None:
    """A spawned rank > 0: build the same engine, serve rank 0's steps, leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    os.environ.update(env)
    try:
        from slotrunner.builder import build_engine

        engine = build_engine(args)
        serve_worker(engine)
    except BaseException:
        errors.put((int(env["RANK"]), traceback.format_exc()))
        raise


def serve_worker(engine: Any) -> None:
    """On a rank > 0: run rank 0's steps until it closes, then leave the group."""
    launch: TensorParallelLaunch = engine.tensor_parallel
    try:
        serve_steps(engine.runner, launch.tp)
    finally:
        launch.close()
