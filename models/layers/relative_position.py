"""T5-style relative position bias: a learned scalar per (head, distance bucket) added to scores.

Encoders add it as a dense [heads, n, n] matrix. Decoders attend over the paged cache, so the
bias goes to the attention backend as a table by distance (`position_bias`, [heads, distances]):
for causal attention every distance past `max_distance` falls into the last bucket, so a table
of `max_distance + 1` columns is exact for any sequence length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.core_runner.attention.layer import Attention


def relative_position_bucket(
    relative_position: torch.Tensor,  # [...] int64, key position - query position
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
) -> torch.Tensor:  # [...] int64 in [0, num_buckets)
    """Half the buckets are exact small distances, half logarithmic up to `max_distance`
    (transformers' T5Attention._relative_position_bucket, the same arithmetic)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Embedding):
    """The learned table ([num_buckets, num_heads], checkpoint name `relative_attention_bias`)
    and its two uses."""

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool) -> None:
        super().__init__(num_buckets, num_heads)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional

    def dense(self, length: int) -> torch.Tensor:  # [num_heads, length, length]
        """Bias between every query and key of one sequence of `length` positions."""
        pos = torch.arange(length, device=self.weight.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1)

    def by_distance(self) -> torch.Tensor:  # [num_heads, max_distance + 1]
        """Causal bias by distance q_pos - k_pos in [0, max_distance]; longer distances share the
        last column (the backend clamps)."""
        assert not self.bidirectional, "a table by distance describes causal attention only"
        distance = torch.arange(self.max_distance + 1, device=self.weight.device)
        buckets = relative_position_bucket(-distance, False, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).t()


class BiasedAttention(Attention):
    """Paged causal self-attention with an additive bias by query-key distance."""

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        position_bias: torch.Tensor,  # [num_heads, num_distances]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        assert self.kv_cache is not None, f"layer {self.layer_idx}: KV cache not bound before the forward"
        ctx = get_forward_context()
        s = self.spec
        out = ctx.backend.forward(
            s,
            q.view(-1, s.num_heads, s.head_dim),
            k.view(-1, s.num_kv_heads, s.head_dim),
            v.view(-1, s.num_kv_heads, s.head_dim),
            self.kv_cache,
            ctx.attn,
            position_bias,
        )
        return out.reshape(-1, s.num_heads * s.head_dim)
