"""The engine builder's process-wide choice: a GPU engine runs torch's CPU ops on one thread.

Guards against: a GPU engine leaving torch's CPU thread pool to contend with its step loop (on
one H200 host the decode-heavy runs were 16% slower with 16 threads), overriding a count the
user chose through OMP_NUM_THREADS, and a count not restored when the engine closes.
"""

from __future__ import annotations

import torch

from slotrunner.builder import _one_cpu_thread
from slotrunner.core_runner.distributed.parallel_state import SINGLE
from slotrunner.tensor_parallel import TensorParallelLaunch


def test_a_gpu_engine_takes_one_cpu_thread_and_gives_it_back(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        launch = TensorParallelLaunch(SINGLE, torch.device("cpu"))
        _one_cpu_thread(launch)
        assert torch.get_num_threads() == 1
        launch.close()
        assert torch.get_num_threads() == 2

        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        launch = TensorParallelLaunch(SINGLE, torch.device("cpu"))
        _one_cpu_thread(launch)
        assert torch.get_num_threads() == 2 and launch.cpu_threads is None
    finally:
        torch.set_num_threads(before)
