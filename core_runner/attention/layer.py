"""Attention layer: the model-side handle of one layer's paged KV cache.

Models call it with projected q/k/v; it forwards to the attention backend of the current
forward context. The runner binds `kv_cache` once after allocating the cache.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionSpec, Rotate
from slotrunner.core_runner.attention.cache_spec import KVCacheSpec, PagedCacheLayer
from slotrunner.core_runner.attention.forward_context import get_forward_context


class Attention(PagedCacheLayer):
    def __init__(self, spec: AttentionSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads, dim], bound by the runner

    def kv_cache_spec(self) -> KVCacheSpec:
        """K and V per KV head: the layout `kv_cache_shape` describes and every backend reads."""
        s = self.spec
        return KVCacheSpec("kv", (2, s.num_kv_heads, s.head_dim), block_dim=1, supports_fp8=True, sliding_window=s.sliding_window)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        sinks: torch.Tensor | None = None,  # [num_heads] attention-sink logits (see AttentionBackend)
        rotate: Rotate | None = None,  # q and k before their rotary embedding: the backend applies it (`Rotate`)
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
            ctx.attn_of(self.kv_group),
            sinks=sinks,
            rotate=rotate,
        )
        return out.reshape(-1, s.num_heads * s.head_dim)
