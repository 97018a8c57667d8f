"""Linear layers whose weight is the concatenation of several checkpoint tensors (qkv, gate_up)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input. `shard_sizes` name the output rows
    of each part, so the loader can copy checkpoint tensor `part` into its rows."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        start, size = self.shard_offsets[shard]
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match expected {expected}")
        with torch.no_grad():
            param[start : start + size].copy_(tensor)
