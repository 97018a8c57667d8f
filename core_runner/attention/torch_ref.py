"""TorchRefBackend: the reference attention backend, plain torch on any device.

It is the specification the Triton backend is tested against, and the backend used on CPU.
Each batch row is handled on its own: gather its keys through its block-table row, mask
causally (and by sliding window), attend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec, write_kv


def paged_attention_ref(
    spec: AttentionSpec,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    position_bias: torch.Tensor | None = None,  # [num_heads, num_distances], see AttentionBackend
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    group = spec.num_heads // spec.num_kv_heads
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    for row in range(meta.num_reqs):
        q_start, q_end = int(qsl[row]), int(qsl[row + 1])
        num_q, seq_len = q_end - q_start, int(seq_lens[row])
        if num_q == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[row, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, dim]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]  # [num_q, 1]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, seq_len]
        allowed = k_pos <= q_pos
        if spec.sliding_window is not None:
            allowed &= q_pos - k_pos < spec.sliding_window
        qh = q[q_start:q_end].transpose(0, 1).to(k.dtype)  # [heads, num_q, dim]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, seq_len, dim]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
        bias = None
        if position_bias is not None:
            distance = (q_pos - k_pos).clamp(0, position_bias.shape[1] - 1)  # [num_q, seq_len]
            bias = position_bias[:, distance].to(qh.dtype)  # [heads, num_q, seq_len]
        if spec.logits_soft_cap is None:
            mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=spec.scale)
        else:
            scores = (qh @ kh.transpose(1, 2)).float() * spec.scale
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            if bias is not None:
                scores = scores + bias.float()
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = (scores.softmax(-1).to(vh.dtype)) @ vh
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        position_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return paged_attention_ref(spec, q, kv_cache, meta, position_bias)
