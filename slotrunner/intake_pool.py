"""IntakePool: a call's prompts read (media decoded and preprocessed) in forked worker processes.

A family whose intake is heavy (`ModelState.intake_workers`) has `LLM.generate` read a call's
prompts in a pool. Threads share the GIL with the thread that steps the engine, which then waits
on the readers after every GPU wait: on one H200 the LLaVA workload of
benchmarks/multimodal_throughput.py took 2.73-2.94 s with its 128 images read by 8 threads while
the engine stepped, 1.77-1.84 s with them read beforehand, and the reading alone 0.37-0.41 s
(benchmarks/RESULTS.md, 2026-12-01 sixth sitting). So a thread pool reads the whole call before
the engine steps, and a CUDA engine reads in processes, which hold their own GIL, stepping on the
prompts already read while the rest are read (`LLM._read_prompts`).

Workers are forked, as torch's DataLoader workers are: they inherit the intake context
(tokenizer, processor, config, the family's class) without pickling or importing anything, and
never touch the GPU. A prompt goes to a worker pickled, its result comes back as one pickled blob
(tensors copied, never shared through file descriptors). A ValueError of a worker (a bad prompt)
is raised in the caller with its message.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import gc
import io
import multiprocessing
import os
import pickle
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from slotrunner.core_runner.engine.intake import IntakeContext, ProcessedPrompt

# None: processes on CUDA engines, threads elsewhere -- a CPU engine's steps are host work that
# the workers compete with for the cores (2 cores: `multimodal_throughput.py --tiny-widths --device
# cpu` took 2.51 s with processes against 1.92 s with threads). Tests and benchmarks set it.
USE_PROCESSES: bool | None = None

_WORKER: tuple[type, IntakeContext] | None = None  # in a worker: the family's class and the context


def use_processes(device_type: str) -> bool:
    """Whether an engine on `device_type` reads heavy prompts in processes: only where fork exists."""
    wanted = device_type == "cuda" if USE_PROCESSES is None else USE_PROCESSES
    return wanted and "fork" in multiprocessing.get_all_start_methods()


def _start_worker(state_cls: type, ctx: IntakeContext) -> None:
    global _WORKER
    _WORKER = (state_cls, ctx)
    import torch

    torch.set_num_threads(1)  # one reader per core: the workers are the parallelism


def _read(prompt: Any) -> bytes:
    assert _WORKER is not None, "intake worker used before its initializer ran"
    state_cls, ctx = _WORKER
    return dumps(state_cls.process_prompt(prompt, ctx))


def _reduce_tensor(t: Any) -> tuple:
    """A CPU tensor pickled as the numpy array over its data, rebuilt by `torch.from_numpy`.
    torch's own pickling goes through `torch.save` / `torch.load` per tensor: 0.8 ms to load
    one 336 px uint8 image in the engine's thread (2 cores), against 0.1 ms this way."""
    import torch

    if t.device.type == "cpu" and not t.requires_grad and not t.is_conj() and not t.is_neg():
        try:
            return torch.from_numpy, (t.numpy(),)
        except TypeError:  # a dtype numpy lacks (bfloat16, ...)
            pass
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


@functools.cache
def _dispatch_table() -> dict:
    import torch

    return {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def dumps(obj: Any) -> bytes:
    """`pickle.dumps`, with plain tensors (`torch.Tensor` itself) as numpy arrays: what a worker
    sends back; `pickle.loads` reads it."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _dispatch_table()
    pickler.dump(obj)
    return buf.getvalue()


@contextlib.contextmanager
def _tokenizers_quiet_in_children():
    """A fast tokenizer that ran in parallel before a fork prints a warning in each child and
    turns its parallelism off there; with TOKENIZERS_PARALLELISM set while the workers are forked,
    they start with it off and say nothing. The parent's setting is restored after."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    if previous is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


@contextlib.contextmanager
def _parent_objects_frozen(may_fork: bool):
    """The engine's objects moved to the collector's permanent generation while workers may be
    forked (`gc.freeze`, made for this): a worker's collector never examines them, so it never
    frees a CUDA tensor it inherited. One H200 run lost a worker that way -- aborted inside a
    collection that ran as the child started (`multiprocessing.util._run_after_forkers`), before
    it read anything. Thawed after, in the engine -- unless the program had frozen objects itself
    (gc.unfreeze would thaw those too): then they stay as it left them."""
    freeze = may_fork and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


class Reading:
    """One prompt being read by a worker: `done()` without waiting, `result()` waits."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ProcessedPrompt:
        return pickle.loads(self._future.result())

    def cancel(self) -> bool:
        return self._future.cancel()


class IntakePool:
    def __init__(self, state_cls: type, ctx: IntakeContext, workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker, initargs=(state_cls, ctx)
        )

    def submit(self, prompt: Any) -> Reading:
        """Queue `prompt` for a worker (the first calls fork them)."""
        may_fork = len(self.worker_pids) < self.workers  # once all are forked, submitting forks nothing
        with warnings.catch_warnings(), _tokenizers_quiet_in_children(), _parent_objects_frozen(may_fork):
            # Python 3.12 warns on fork() in a process with threads (the engine's process has
            # torch's); the workers run only the intake, as DataLoader workers do.
            warnings.simplefilter("ignore", DeprecationWarning)
            return Reading(self._pool.submit(_read, prompt))

    @property
    def worker_pids(self) -> list[int]:
        """The workers started so far (they start on the first prompts submitted)."""
        return list(self._pool._processes or {})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
