"""Ops shared by the media towers (CLIP, Qwen2-VL vision, Qwen2-Audio encoder): their attention
and their MLP.

A tower sees one whole media item at a time, so its attention is non-causal and needs no KV
cache: plain scaled-dot-product attention over the item's tokens, per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.layers.hf_act import Act


class TowerMLP(nn.Module):
    """fc2(act(fc1(x))): the MLP of a ViT block (CLIP, Qwen2-VL vision), checkpoint names `fc1`, `fc2`."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = Act(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return self.fc2(self.act(self.fc1(x)))


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
