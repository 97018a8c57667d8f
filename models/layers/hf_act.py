"""Activation functions by their Hugging Face config name (`activation_function`, `dense_act_fn`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # NemotronH
    "silu": F.silu,
    "swish": F.silu,
}


def hf_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function transformers' ACT2FN[name] computes; ValueError for a name not listed."""
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(_ACTS)})")
    return _ACTS[name]
