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
timeout). A step interrupted on rank 0 alone (KeyboardInterrupt) leaves the other ranks inside
it: the runner refuses every later step, saying so, instead of pairing collectives wrongly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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

    def execute_model(self, sched: SchedulerOutput) -> None:
        self._check()
        try:
            self.tp.broadcast_step(sched)
        except Exception as e:
            self._fail(f"sending the step to the other ranks failed ({type(e).__name__}: {e})")
        self._guarded(super().execute_model, sched)

    def sample_tokens(self) -> AsyncOutput:
        return self._guarded(super().sample_tokens)

    def shutdown(self) -> None:
        """Tell the other ranks to leave their loop (idempotent; skipped once the group broke)."""
        if self._broken is None:
            self._broken = "the engine was closed"
            try:
                self.tp.broadcast_step(None)
            except Exception as e:  # a rank already gone: nothing to stop there
                logger.warning("tensor-parallel shutdown could not reach every rank: %s", e)

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


def serve_steps(runner: ModelRunner, tp: TensorParallelGroup) -> None:
    """The loop of a rank > 0: run each step rank 0 sends, until it sends None."""
    assert not tp.is_driver, "rank 0 runs the engine, not this loop"
    while True:
        sched = tp.broadcast_step(None)
        if sched is None:
            return
        try:
            runner.execute_model(sched)
            runner.sample_tokens().get()  # the host side too: speculative steps update counts there
        except Exception:
            # Rank 0 raised the same (same code, same data) and failed the step's requests.
            logger.exception("tensor-parallel rank %d: step failed; discarded as on rank 0", tp.rank)
            runner.discard_step()
