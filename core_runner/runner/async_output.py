"""AsyncOutput: a step's small results copied to the host without waiting for them.

The copy is queued on the step's own stream, after the step's kernels: the host goes on
(scheduling, bookkeeping) and blocks only in `get()`, on an event that marks the end of the
copy. On CPU the tensors are already on the host and `get()` returns at once.

No side stream: switching to one and making it wait on the step's stream cost ~0.1-0.15 ms of
host time a step on one H100's host (a line profile of the step), several times what the copy of a
few hundred bytes holds up the next step's kernels on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slotrunner.core_runner.runner.outputs import ModelRunnerOutput


def step_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The CUDA stream a runner's steps run on: the one current when the runner is built (None
    off CUDA). Looked up once: `torch.cuda.current_stream()` costs tens of microseconds of host
    time a call on a GPU host, and a step would make several."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def check_step_stream(stream: torch.cuda.Stream | None) -> None:
    """Raise unless the current stream is `stream` (a C call, ~1 us): the step's events and
    copies are queued on it, so kernels launched on another stream would race them."""
    if stream is not None and torch._C._cuda_getCurrentStream(stream.device_index)[0] != stream.stream_id:
        raise RuntimeError(
            f"this engine's steps run on the CUDA stream current when it was built ({stream}), but the current "
            f"stream is now {torch.cuda.current_stream(stream.device_index)}: call it outside `torch.cuda.stream(...)`, "
            "or build the engine inside the same stream context"
        )


class AsyncOutput:
    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        finish: Callable[[dict[str, torch.Tensor]], ModelRunnerOutput],
        stream: torch.cuda.Stream | None,  # the step's stream (step_stream); None: the tensors are on the host
    ) -> None:
        self._finish = finish
        self._done: torch.cuda.Event | None = None
        if stream is None:
            self._host = tensors
            return
        # Pinned destinations: the copies are truly asynchronous.
        self._host = {k: v.to("cpu", non_blocking=True) for k, v in tensors.items()}
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def get(self) -> ModelRunnerOutput:
        if self._done is not None:
            self._done.synchronize()
        return self._finish(self._host)


def done(output: ModelRunnerOutput) -> AsyncOutput:
    """An AsyncOutput that is already on the host (an empty step)."""
    return AsyncOutput({}, lambda _: output, None)
