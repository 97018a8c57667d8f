"""The paged KV cache: one tensor per caching layer, laid out as the layer declares, bound once.

Every `PagedCacheLayer` in the model declares its entries per token (`KVCacheSpec`: full
attention's K and V per KV head, an MLA latent, ...); the cache is sized and allocated from
those specs alone, so a new layout needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.attention.cache_spec import PagedCacheLayer


def cache_layers(model: nn.Module) -> list[PagedCacheLayer]:
    return [m for m in model.modules() if isinstance(m, PagedCacheLayer)]


def check_kv_cache_dtype(model: nn.Module, kv_cache_dtype: torch.dtype) -> None:
    """Raise ValueError unless every caching layer can keep its cache in `kv_cache_dtype`
    (float8 needs kernels that read it: `KVCacheSpec.supports_fp8`)."""
    if kv_cache_dtype.itemsize != 1:
        return
    kinds = sorted({s.kind for s in (layer.kv_cache_spec() for layer in cache_layers(model)) if not s.supports_fp8})
    if kinds:
        raise ValueError(
            f"kv_cache_dtype='fp8': this model's {', '.join(kinds)} cache has no fp8 kernels; leave kv_cache_dtype='auto'"
        )


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all caching layers, from each layer's declared spec
    (`dtype`: the KV-cache dtype, for specs that leave theirs open)."""
    return sum(layer.kv_cache_spec().bytes_per_block(block_size, dtype) for layer in cache_layers(model))


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Allocate each layer's cache and bind it to the layer; returns them in layer order."""
    caches = []
    for layer in cache_layers(model):
        spec = layer.kv_cache_spec()
        # Uninitialised on purpose: every position is written before it is read (a row reads only
        # its first seq_len positions), and untouched pages of a large CPU cache cost nothing.
        cache = torch.empty(spec.cache_shape(num_blocks, block_size), dtype=spec.dtype_for(dtype), device=device)
        layer.kv_cache = cache
        caches.append(cache)
    return caches
