"""Multimodal RoPE (M-RoPE, Qwen2-VL): three position axes (temporal, height, width).

Each request's positions are [3, num_tokens]: text tokens carry the same position on all three
axes; an image's tokens carry their grid coordinates. The rotary channels are split into
`mrope_section` groups, and group i rotates by axis i % 3.

The positions of a prompt are computed once when the request is admitted
(`qwen2_vl_prompt_positions`); every later token i (decode, or generated tokens recomputed after
a preemption) sits at `i + delta` on all three axes, where
`delta` = (largest prompt position + 1) - prompt_len.
"""

from __future__ import annotations

import torch

from slotrunner.models.layers.rotary import KVWrite, RopeConfig, RotaryEmbedding, _rotate


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose channel groups follow different position axes. Also accepts plain 1-D
    positions (all three axes equal: a text-only batch)."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, mrope_section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_position, rope)
        if sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}; it must cover the "
                f"{self.rotary_dim // 2} rotary frequencies (rotary_dim / 2)"
            )
        self.mrope_section = tuple(mrope_section)

    def forward(
        self,
        positions: torch.Tensor,  # [3, num_tokens] or [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv: KVWrite | None = None,  # the attention backend's K/V write (`rotary_qk`)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k, kv)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # each [3, num_tokens, rotary_dim // 2]
        cos, sin = _select_axes(cos, self.mrope_section), _select_axes(sin, self.mrope_section)
        q, k = _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)
        if kv is not None:
            kv.write(k)
        return q, k


def _select_axes(freqs: torch.Tensor, sections: tuple[int, ...]) -> torch.Tensor:
    """[3, n, d] -> [n, d]: channel group i taken from axis i % 3."""
    parts = freqs.split(list(sections), dim=-1)
    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


def qwen2_vl_prompt_positions(
    prompt_len: int,
    spans: list[tuple[int, int, int, int]],  # (offset, grid_t, grid_h, grid_w) per media item, in prompt order
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, prompt_len] of a prompt, and the delta that places every later
    token (`i + delta` on all axes). Mirrors transformers' `Qwen2VLModel.get_rope_index` for one
    unpadded sequence."""
    pieces: list[torch.Tensor] = []
    cursor, current = 0, 0  # cursor: prompt index; current: the next text position

    def text(end: int) -> None:
        nonlocal cursor, current
        if end > cursor:
            pieces.append(torch.arange(end - cursor).expand(3, -1) + current)
            current += end - cursor
            cursor = end

    for offset, t, h, w in spans:
        text(offset)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
        cursor = offset + t * gh * gw
        current += max(gh, gw)
    text(prompt_len)
    positions = torch.cat(pieces, dim=1)  # [3, prompt_len]
    assert positions.shape[1] == prompt_len, f"M-RoPE spans cover {positions.shape[1]} of {prompt_len} prompt tokens"
    return positions, int(positions.max()) + 1 - prompt_len
