"""Gated activations on a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedAct(nn.Module):
    """act(gate) * up, where the input is [..., 2 * d] = [gate | up]."""

    def __init__(self, act: str) -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"activation {act!r} is not supported (supported: {sorted(_ACTS)})")
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
