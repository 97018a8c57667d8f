"""Qwen2-Audio encoder: Whisper-style convolutions + transformer over log-mel frames, then a
2x average pool. Input frames past an item's length (its feature_attention_mask) are padding:
no token attends to them, and only the first `output_length` pooled frames are kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.layers.hf_act import Act
from slotrunner.models.layers.tower_ops import tower_attention


def audio_output_lengths(num_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths after conv2 (stride 2) and after the pool: (encoder frames, embeddings)."""
    after_conv = (num_frames - 1) // 2 + 1
    return after_conv, (after_conv - 2) // 2 + 1


class AudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:  # [batch, frames, dim]
        shape = (*x.shape[:2], self.num_heads, self.head_dim)
        # transformers scales q before the product (and attends with scale 1): same order here.
        q = (self.q_proj(x) * self.head_dim**-0.5).view(shape)
        out = tower_attention(q, self.k_proj(x).view(shape), self.v_proj(x).view(shape), 1.0, key_mask)
        return self.out_proj(out)


class AudioEncoderLayer(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.self_attn = AudioAttention(c.d_model, c.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.act = Act(c.activation_function)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioEncoder(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.num_frames = 2 * c.max_source_positions  # the padded input length the positions fit
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.d_model)
        self.layers = nn.ModuleList(AudioEncoderLayer(c) for _ in range(c.encoder_layers))
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(
        self,
        features: torch.Tensor,  # [batch, mel, num_frames]
        frame_mask: torch.Tensor,  # [batch, num_frames] 1 = real frame
    ) -> torch.Tensor:  # [batch, num_frames / 4, d_model]
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2) + self.embed_positions.weight  # [batch, frames / 2, d_model]
        lengths, _ = audio_output_lengths(frame_mask.sum(-1))
        key_mask = torch.arange(x.shape[1], device=x.device)[None, :] < lengths.to(x.device)[:, None]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)
