"""Rotary position embedding (neox layout, as Hugging Face Llama-family checkpoints use).

`RopeConfig` (read from the HF config) -> the cos/sin table of `RotaryEmbedding`, applied by
`rotary_qk` (rotary_qk.py: one Triton launch for q and k, optionally after Qwen3's per-head
q/k norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.rotary_qk import QKNorm, _rotate, rotary_qk  # noqa: F401 (_rotate: M-RoPE, vision)


@dataclass(frozen=True)
class RopeConfig:
    """Read once from the HF config; transformers 5.x nests it under `rope_parameters`,
    4.x puts `rope_theta` / `rope_scaling` at the top level."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf_config: object) -> RopeConfig:
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        scaling = getattr(hf_config, "rope_scaling", None)
        if isinstance(scaling, dict):
            params = {**scaling, **params}
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            partial_rotary_factor=float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0)),
        )


def _inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of their first `rotary_dim` channels, by position."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), _inv_freq(rope, self.rotary_dim))
        # [max_position, rotary_dim]: cos and sin halves, recomputed on load rather than stored.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """May write q and k in place (see `rotary_qk`): use the returned tensors."""
        return rotary_qk(positions, q, k, self.cos_sin)

    def norm_and_rotate(
        self,
        positions: torch.Tensor,  # [num_tokens], or [3, num_tokens] for M-RoPE
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm: RMSNorm,
        k_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(positions, q_norm(q), k_norm(k))` (Qwen3), in one kernel for 1-D positions.
        Subclasses whose forward differs for 1-D positions must override this too; M-RoPE's
        does not (its 1-D case is plain RoPE) and its 3-axis case takes the unfused path."""
        if positions.dim() != 1:
            return self(positions, q_norm(q), k_norm(k))
        return rotary_qk(positions, q, k, self.cos_sin, QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps))
