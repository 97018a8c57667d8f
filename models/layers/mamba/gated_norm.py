"""Gated RMSNorm with groups: the Mamba2 mixer's output norm (`norm_before_gate=False`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm_per_group(x * silu(gate)), in float32. Each of the `hidden_size //
    group_size` groups is normalised on its own (Mamba2 uses one group per `n_groups`)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of group_size={group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        gate: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of x
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        h = h.view(*h.shape[:-1], -1, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(x.shape).to(dtype)
