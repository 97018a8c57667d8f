"""Qwen2-VL vision tower: a ViT over flattened patches with 2-D rotary positions, then a
merger that folds each spatial_merge_size^2 block of patches into one language-model embedding.

Patches arrive as the processor emits them: [num_patches, C * temporal_patch * patch^2], each
image's patches in merge-block-major order. Attention stays within one frame of one image.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.layers.rotary import _rotate
from slotrunner.models.layers.tower_ops import TowerMLP, tower_attention


class VisionRotary(nn.Module):
    """2-D RoPE: the first half of the frequencies follow the patch row, the second the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)), persistent=False
        )

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, 2] -> cos, sin [n, head_dim / 2]
        freqs = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [n, 2 * head_dim / 4]
        return freqs.cos(), freqs.sin()


def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch, in the processor's merge-block-major order: [num_patches, 2]."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)  # each [n, heads, dim]
        q, k = _rotate(q, cos, sin, self.head_dim), _rotate(k, cos, sin, self.head_dim)
        outs = [
            tower_attention(qi[None], ki[None], vi[None], self.head_dim**-0.5)[0]
            for qi, ki, vi in zip(q.split(frame_lens), k.split(frame_lens), v.split(frame_lens))
        ]
        return self.proj(torch.cat(outs))


class VisionBlock(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.attn = VisionAttention(c.embed_dim, c.num_heads)
        self.norm2 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.mlp = TowerMLP(c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """transformers' Conv3d whose kernel is the whole patch: a matmul with the flattened kernel
    (the checkpoint keeps the Conv3d shape). As a matmul it also escapes cuDNN's TF32
    convolutions, which move fp32 logits on a GPU by ~1e-4."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [n, C * T * P * P] -> [n, embed_dim]
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge**2
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, dim] -> [n / merge^2, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VLVisionTower(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.merge = c.spatial_merge_size
        self.patch_embed = PatchEmbed(c)
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary = VisionRotary(c.embed_dim // c.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c.hidden_size, c.embed_dim, c.spatial_merge_size)

    def forward(
        self,
        patches: torch.Tensor,  # [num_patches, C * T * P * P], images concatenated
        grid_thw: torch.Tensor,  # [num_images, 3] (host)
    ) -> torch.Tensor:  # [num_patches / merge^2, hidden]
        x = self.patch_embed(patches)
        cos, sin = self.rotary(patch_rows_cols(grid_thw, self.merge).to(x.device))
        frame_lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lens)
        return self.merger(x)
