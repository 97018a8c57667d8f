"""`collector_paused`: a collection before the capture, none during it, the collector as it was after.

Guards against: a capture that a garbage collection interrupts (an earlier engine's CUDA graphs
destroyed while a stream captures invalidate the capture), and a pause that leaves the collector
off for the rest of the process, or turns it on where the caller had it off.
"""

from __future__ import annotations

import gc

import pytest

from slotrunner.core_runner.graph_capture import collector_paused


class _Cycle:
    freed = 0

    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it

    def __del__(self) -> None:
        _Cycle.freed += 1


def test_collects_first_then_none_until_the_end():
    _Cycle.freed = 0
    _Cycle()  # garbage in a cycle, left for the collector
    runs = []
    gc.callbacks.append(lambda phase, info: runs.append(phase))
    try:
        with collector_paused():
            assert _Cycle.freed == 1, "the cycle left before the capture was not collected"
            assert not gc.isenabled()
            runs.clear()
            for _ in range(20_000):  # allocations that would trigger a collection
                _Cycle()
            assert runs == [], "a collection ran inside the pause"
        assert gc.isenabled()
    finally:
        gc.callbacks.pop()
    gc.collect()


def test_restores_a_disabled_collector_and_survives_an_exception():
    gc.disable()
    try:
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("capture failed")
        assert not gc.isenabled(), "the caller had it off"
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
