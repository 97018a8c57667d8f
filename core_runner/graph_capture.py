"""CUDA-graph captures with Python's garbage collector held off.

A collection that runs during a capture may free an earlier engine of the process that only a
reference cycle kept alive -- its CUDA graphs among it, whose destructors destroy their graph
executables -- and CUDA refuses that while a stream captures in the default (global) mode: the
capture is invalidated and fails ("operation not permitted when stream is capturing", seen on one
H200 when a test built a second engine after dropping a first). So every capture runs inside
`collector_paused()`: one collection before it, none until it ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect now, then keep the cyclic garbage collector off until the block ends (as it was
    before, if it was already off)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
