"""Dense attention over one unpaged sequence: encoder self-attention and cross-attention.

Encoders see a request's whole input at once and attend in both directions, so they need
neither the paged KV cache nor the step's metadata; one call covers one request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_attention(
    q: torch.Tensor,  # [num_q, num_heads, head_dim]
    k: torch.Tensor,  # [num_k, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    bias: torch.Tensor | None = None,  # [num_heads, num_q, num_k] added to the scaled scores
) -> torch.Tensor:  # [num_q, num_heads * head_dim]
    """Every query attends to every key (no causal mask)."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [heads, num_q, dim]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0).to(qh.dtype)  # [heads, num_k, dim]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0).to(qh.dtype)
    mask = None if bias is None else bias.to(qh.dtype)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # [heads, num_q, dim]
    return o.transpose(0, 1).reshape(q.shape[0], -1)
