"""CLIP vision tower (LLaVA's image encoder): patch embedding + class token + pre-norm ViT.

Only the layers up to the deepest feature layer the projector reads are run; the rest are
loaded (they are in the checkpoint) but skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slotrunner.models.layers.linear import MergedLinear
from slotrunner.models.layers.tower_ops import TowerMLP, tower_attention


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = MergedLinear(dim, {"q": dim, "k": dim, "v": dim}, bias=True)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, seq, dim]
        q, k, v = self.qkv_proj(x).view(*x.shape[:2], 3, self.num_heads, self.head_dim).unbind(2)
        return self.out_proj(tower_attention(q, k, v, self.head_dim**-0.5))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = CLIPAttention(c.hidden_size, c.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = TowerMLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.image_size, self.patch_size = c.image_size, c.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False)
        self.position_embedding = nn.Embedding((c.image_size // c.patch_size) ** 2 + 1, c.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [batch, 3, H, W] -> [batch, 1 + patches, dim]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPEncoder(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(c) for _ in range(c.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """Returns the hidden states of the requested layers, concatenated on the channel axis.

    Layer indices follow transformers' `hidden_states`: 0 is the (pre-normed) embedding output,
    i the output of layer i, negatives count from the end (-1 = last layer).
    """

    def __init__(self, c: Any, feature_layers: list[int]) -> None:
        super().__init__()
        num_layers = c.num_hidden_layers
        self.feature_layers = [f if f >= 0 else num_layers + 1 + f for f in feature_layers]
        if not all(0 <= f <= num_layers for f in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the {num_layers}-layer vision tower")
        self.embeddings = CLIPEmbeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)  # sic: transformers' name
        self.encoder = CLIPEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)  # pooled output only: loaded, unused

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [batch, 3, H, W] -> [batch, 1 + patches, dim * n]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[: max(self.feature_layers)]:
            x = layer(x)
            states.append(x)
        return torch.cat([states[f] for f in self.feature_layers], dim=-1)
