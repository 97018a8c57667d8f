"""The paged KV cache: one tensor per attention layer, bound to the layer once."""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import kv_cache_shape
from slotrunner.core_runner.attention.layer import Attention


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all attention layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * a.spec.num_kv_heads * a.spec.head_dim * elem for a in attention_layers(model))


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Allocate each layer's cache and bind it to the layer; returns them in layer order."""
    caches = []
    for layer in attention_layers(model):
        s = layer.spec
        # Uninitialised on purpose: every position is written before it is read (a row reads only
        # its first seq_len positions), and untouched pages of a large CPU cache cost nothing.
        cache = torch.empty(kv_cache_shape(num_blocks, block_size, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
        layer.kv_cache = cache
        caches.append(cache)
    return caches

