"""Activation functions by their Hugging Face config name (`hidden_act`, `activation_function`,
`dense_act_fn`): the one table every layer reads, as a function (`hf_activation`) or a module
(`Act`). The gated-activation kernel (`activation.py`) knows its functions by identity, so two
names of one function (`swish`, `silu`) run the same kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:  # CLIP
    return x * torch.sigmoid(1.702 * x)


def relu2(x: torch.Tensor) -> torch.Tensor:  # NemotronH
    return torch.square(F.relu(x))


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "relu2": relu2,
    "silu": F.silu,
    "swish": F.silu,
}


def hf_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function transformers' ACT2FN[name] computes; ValueError for a name not listed."""
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(_ACTS)})")
    return _ACTS[name]


class Act(nn.Module):
    """`hf_activation(name)` as a module, for towers and projectors built as module trees."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = hf_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name
