"""Tensor parallelism on torch.distributed: the rank's group and its collectives
(`parallel_state.py`), and which part of a weight or of the heads a rank owns (`shard.py`).

NCCL carries the tensor collectives on GPUs and gloo on CPUs (the same code); the step's
inputs travel from rank 0 on a gloo group of their own. The layers that use this live in
`models/layers/parallel_linear.py`; the runner side (rank 0 broadcasting each step, the other
ranks' loop) in `core_runner/runner/parallel_runner.py`.
"""
