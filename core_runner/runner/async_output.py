"""AsyncOutput: a step's small results copied to the host on a side stream.

The copy waits for the step's kernels on the GPU, not on the host: the host goes on (scheduling,
bookkeeping) and blocks only in `get()`, on an event that marks the end of the copy. On CPU the
tensors are already on the host and `get()` returns at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slotrunner.core_runner.runner.outputs import ModelRunnerOutput


class AsyncOutput:
    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        finish: Callable[[dict[str, torch.Tensor]], ModelRunnerOutput],
        copy_stream: torch.cuda.Stream | None,
    ) -> None:
        self._finish = finish
        self._done: torch.cuda.Event | None = None
        if copy_stream is None:
            self._host = tensors
            return
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            # Pinned destinations: the copies are truly asynchronous.
            self._host = {k: v.to("cpu", non_blocking=True) for k, v in tensors.items()}
            for v in tensors.values():
                v.record_stream(copy_stream)  # the allocator must not reuse v before the copy ran
            self._done = torch.cuda.Event()
            self._done.record(copy_stream)

    def get(self) -> ModelRunnerOutput:
        if self._done is not None:
            self._done.synchronize()
        return self._finish(self._host)


def done(output: ModelRunnerOutput) -> AsyncOutput:
    """An AsyncOutput that is already on the host (an empty step)."""
    return AsyncOutput({}, lambda _: output, None)
