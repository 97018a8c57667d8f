"""Tensor-parallel execution: rank 0's runner sends each step to the other ranks, which run it too.

Every rank holds its shard of the model and a whole `ModelRunner` (slots, block tables, sampling
tables), and every rank runs every step: the same forward (its collectives join the ranks) and
the same sampling over the gathered logits, so each rank's tables stay equal to rank 0's without
any other message. Only rank 0 has an engine (scheduler, outputs); it sends the step's
`SchedulerOutput` in one broadcast before running it (`TensorParallelRunner.execute_model`),
and the other ranks loop in `serve_steps` until rank 0 sends None (shutdown).

Failures: a step that raises an Exception raises it on every rank (the ranks run the same code
on the same data); rank 0's engine fails the step's requests and each other rank discards the
step, and all go on together. A rank that dies fails rank 0's next step with an error naming it
(`check_peers`), or fails the collective it was part of (gloo: at once; NCCL: after the group's
timeout). Ctrl-C (SIGINT) on rank 0 is held from the step's broadcast to the end of its
sampling (`_HeldInterrupt`), so every rank finishes the step, then it is raised and the engine
rolls the step back as it does on one device; the other ranks ignore SIGINT. A step cut short
on rank 0 alone all the same (another BaseException) leaves the other ranks inside it: the
runner then refuses every later step, saying so, instead of pairing collectives wrongly.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from torch import nn

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup
from slotrunner.core_runner.runner.async_output import AsyncOutput
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.core_runner.runner.model_state import ModelState
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class TensorParallelBroken(RuntimeError):
    """The ranks can no longer run steps together; the engine must be closed and rebuilt."""


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: a `ModelRunner` that first sends each step to the other ranks."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        model_state: ModelState,
        tp: TensorParallelGroup,
        check_peers: Callable[[], None] | None = None,  # raises naming a rank that has died
    ) -> None:
        assert tp.is_driver and tp.world_size > 1, "only rank 0 of a group of several ranks sends steps"
        super().__init__(config, model, model_state)
        self.tp = tp
        self._check_peers = check_peers
        self._broken: str | None = None  # why no further step can run
        self._interrupt = _HeldInterrupt()

    def execute_model(self, sched: SchedulerOutput) -> None:
        self._check()
        self._interrupt.hold()
        try:
            try:
                self.tp.broadcast_step(sched)
            except Exception as e:
                self._fail(f"sending the step to the other ranks failed ({type(e).__name__}: {e})")
            self._guarded(super().execute_model, sched)
        except BaseException:
            self._interrupt.release()
            raise

    def sample_tokens(self) -> AsyncOutput:
        try:
            return self._guarded(super().sample_tokens)
        finally:
            self._interrupt.release()  # the step is over on every rank: a held Ctrl-C raises now

    def discard_step(self) -> None:
        super().discard_step()
        self._interrupt.release()

    def shutdown(self) -> bool:
        """Tell the other ranks to leave their loop; returns whether they were told (not when
        the group broke before, or on a second call)."""
        if self._broken is not None:
            return False
        self._broken = "the engine was closed"
        try:
            self.tp.broadcast_step(None)
            self.tp.leave_together()  # the other ranks do the same on leaving their loop (serve_steps)
        except Exception as e:  # a rank already gone: nothing to stop there
            logger.warning("tensor-parallel shutdown could not reach every rank: %s", e)
            return False
        return True

    def _guarded(self, fn: Callable, *args: object) -> object:
        try:
            return fn(*args)
        except Exception:
            self._check()  # a dead rank is the better explanation than the collective's error
            raise
        except BaseException as e:
            self._broken = (
                f"a step was interrupted on rank 0 ({type(e).__name__}) while the other ranks ran it, so they are "
                "no longer in step"
            )
            raise

    def _check(self) -> None:
        if self._broken is not None:
            raise TensorParallelBroken(f"tensor-parallel engine cannot run steps: {self._broken}; build a new LLM")
        if self._check_peers is not None:
            try:
                self._check_peers()
            except Exception as e:
                self._fail(str(e))

    def _fail(self, reason: str) -> None:
        self._broken = reason
        raise TensorParallelBroken(f"tensor-parallel engine cannot run steps: {reason}; build a new LLM")


class _HeldInterrupt:
    """SIGINT held while a step runs (main thread only: Python runs signal handlers there), then
    delivered to the handler it found once the step is over."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._pending = False

    def hold(self) -> None:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGINT, self._note)

    def release(self) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        self._previous = None
        if self._pending:
            self._pending = False
            signal.raise_signal(signal.SIGINT)  # the restored handler: KeyboardInterrupt by default

    def _note(self, signum: int, frame: Any) -> None:
        self._pending = True


def serve_steps(runner: ModelRunner, tp: TensorParallelGroup) -> None:
    """The loop of a rank > 0: run each step rank 0 sends, until it sends None."""
    assert not tp.is_driver, "rank 0 runs the engine, not this loop"
    while True:
        sched = tp.broadcast_step(None)
        if sched is None:
            tp.leave_together()  # with rank 0 (`shutdown`), before either tears the group down
            return
        try:
            runner.execute_model(sched)
            runner.sample_tokens().get()  # the host side too: speculative steps update counts there
        except Exception:
            # Rank 0 raised the same (same code, same data) and failed the step's requests.
            logger.exception("tensor-parallel rank %d: step failed; discarded as on rank 0", tp.rank)
            runner.discard_step()
