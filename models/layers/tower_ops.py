"""Ops shared by the media towers (CLIP, Qwen2-VL vision, Qwen2-Audio encoder).

A tower sees one whole media item at a time, so its attention is non-causal and needs no KV
cache: plain scaled-dot-product attention over the item's tokens, per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class Act(nn.Module):
    """An activation by its Hugging Face name (`hidden_act` / `activation_function`)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in _ACTS:
            raise ValueError(f"activation {name!r} is not supported by the media towers (supported: {sorted(_ACTS)})")
        self.fn = _ACTS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def tower_attention(
    q: torch.Tensor,  # [batch, seq, num_heads, head_dim]
    k: torch.Tensor,  # [batch, seq, num_heads, head_dim]
    v: torch.Tensor,  # [batch, seq, num_heads, head_dim]
    scale: float,
    key_mask: torch.Tensor | None = None,  # [batch, seq] bool, True = attend (False: padding)
) -> torch.Tensor:  # [batch, seq, num_heads * head_dim]
    """Non-causal attention within each item of the batch."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).flatten(2)
