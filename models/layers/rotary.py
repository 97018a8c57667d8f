"""Rotary position embedding (neox layout, as Hugging Face Llama-family checkpoints use).

`RopeConfig` (read from the HF config) -> the cos/sin table of `RotaryEmbedding`, applied by
`rotary_qk` (rotary_qk.py: one Triton launch for q and k, optionally after Qwen3's per-head
q/k norm).

LongRoPE (Phi-3's `rope_type` "longrope") divides each frequency by a factor and scales cos and
sin by `attention_factor`. transformers rotates a whole sequence by the long factors once it is
longer than `original_max_position_embeddings` (a forward whose largest position + 1 exceeds
it; `generate` drops its cache and recomputes the sequence the moment it crosses), by the short
ones before. A paged KV cache cannot re-rotate the keys it holds, so one set serves every
position: the long one when the model can outgrow the limit (`max_position_embeddings` beyond
it: every Phi-3 128k checkpoint), which equals transformers at every position of a sequence past
the limit; the short one otherwise, which equals it everywhere. The one divergence: a sequence
that stays within the limit on a model that can outgrow it is rotated by the long factors here,
by the short ones in transformers (vLLM makes the same choice, keyed on its max_model_len).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.rotary_qk import KVWrite, QKNorm, _rotate, rotary_qk  # noqa: F401 (_rotate: M-RoPE, vision)


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
    # longrope: the per-frequency divisors in use (the short or long set, see the module
    # docstring) and the scale of cos and sin (transformers' `attention_factor`)
    ext_factors: tuple[float, ...] | None = None
    attention_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf_config: object, layer_type: str | None = None) -> RopeConfig:
        """`layer_type` picks one entry of parameters nested by layer type (Gemma3's
        `rope_parameters["sliding_attention"]`); flat parameters serve every layer type."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        scaling = getattr(hf_config, "rope_scaling", None)
        if isinstance(scaling, dict):
            params = {**scaling, **params}
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, longrope, yarn)"
            )
        fields = dict(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            partial_rotary_factor=float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0)),
        )
        if rope_type == "longrope":
            fields.update(_longrope_fields(hf_config, params))
        elif rope_type == "yarn":
            fields.update(_yarn_fields(hf_config, params, fields["theta"], fields["partial_rotary_factor"]))
        return cls(**fields)


def _longrope_fields(hf_config: object, params: dict) -> dict:
    """The longrope fields as transformers' `_compute_longrope_parameters` reads them (`factor`
    defaults to max_position_embeddings / original_max_position_embeddings, the attention factor
    to sqrt(1 + ln(factor) / ln(original)) when the factor exceeds 1), with the factor set chosen
    once: long when max_position_embeddings exceeds the original length (module docstring)."""
    original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", None)
    if original is None or params.get("short_factor") is None or params.get("long_factor") is None:
        raise ValueError("rope_type 'longrope' needs short_factor, long_factor and original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = hf_config.max_position_embeddings > original
    return dict(
        original_max_position_embeddings=int(original),
        ext_factors=tuple(float(f) for f in params["long_factor" if long else "short_factor"]),
        attention_factor=float(attention_factor),
    )


def _yarn_fields(hf_config: object, params: dict, theta: float, partial_rotary_factor: float) -> dict:
    """YaRN (GPT-OSS, DeepSeek-V3) as transformers' `_compute_yarn_parameters` computes it: each
    frequency blends its interpolated (divided by `factor`) and original value by a linear ramp
    between the correction dims of `beta_fast` and `beta_slow` rotations -- here one divisor per
    frequency, 1 / ((1 - e) / factor + e) with e the extrapolated share -- and cos and sin are
    scaled by the attention factor (0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_type 'yarn' needs original_max_position_embeddings")
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * partial_rotary_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    extrapolated = [1 - min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return dict(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        ext_factors=tuple(1.0 / ((1 - e) / factor + e) for e in extrapolated),
        attention_factor=float(attention_factor),
    )


def _inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if rope.rope_type in ("longrope", "yarn"):  # one divisor per frequency
        if len(rope.ext_factors) != rotary_dim // 2:
            raise ValueError(f"{rope.rope_type} factors have {len(rope.ext_factors)} entries; rotary_dim {rotary_dim} needs {rotary_dim // 2}")
        return 1.0 / (torch.tensor(rope.ext_factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
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
        cos, sin = freqs.cos(), freqs.sin()
        if rope.attention_factor != 1.0:
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        # [max_position, rotary_dim]: cos and sin halves, recomputed on load rather than stored.
        self.register_buffer("cos_sin", torch.cat([cos, sin], dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv: KVWrite | None = None,  # the attention backend's K/V write (`rotary_qk`)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """May write q and k in place (see `rotary_qk`): use the returned tensors."""
        return rotary_qk(positions, q, k, self.cos_sin, kv=kv)

    def norm_and_rotate(
        self,
        positions: torch.Tensor,  # [num_tokens], or [3, num_tokens] for M-RoPE
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        kv: KVWrite | None = None,  # the attention backend's K/V write (`rotary_qk`)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(positions, q_norm(q), k_norm(k))` (Qwen3), in one kernel for 1-D positions.
        Subclasses whose forward differs for 1-D positions must override this too; M-RoPE's
        does not (its 1-D case is plain RoPE) and its 3-axis case takes the unfused path."""
        if positions.dim() != 1:
            return self(positions, q_norm(q), k_norm(k), kv)
        assert q_norm.unit_offset == k_norm.unit_offset, "q_norm and k_norm differ in unit_offset"
        norms = QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, q_norm.unit_offset)
        return rotary_qk(positions, q, k, self.cos_sin, norms, kv)
