"""The KV cache is sized and allocated from the specs the layers declare.

Guards against: a layer with its own cache layout (an MLA latent) sized as if it held K and V per
head -- a cache several times too small or too large -- or allocated in the wrong shape; the
full-attention layout drifting from the one every attention backend reads (`kv_cache_shape`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec, kv_cache_shape
from slotrunner.core_runner.attention.cache_spec import KVCacheSpec, PagedCacheLayer
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.core_runner.runner.kv_cache import allocate_kv_cache, cache_layers, kv_bytes_per_block


class _LatentLayer(PagedCacheLayer):
    def __init__(self, width: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kv_cache = None
        self.width, self.dtype = width, dtype

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec("latent", (self.width,), self.dtype)


def _model() -> nn.Module:
    return nn.ModuleList([
        Attention(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=1.0), 0),
        nn.Sequential(_LatentLayer(13)),
        _LatentLayer(5, torch.float32),
    ])  # fmt: skip


def test_attention_declares_the_layout_backends_read():
    spec = Attention(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=1.0), 0).kv_cache_spec()
    assert spec.cache_shape(7, 4) == kv_cache_shape(7, 4, 2, 8)


def test_bytes_per_block_sum_each_layers_spec():
    model = _model()
    assert len(cache_layers(model)) == 3
    # bf16 engine: K+V 2*2*8 and a 13-wide latent at 2 bytes, a float32 5-wide entry at 4 bytes.
    assert kv_bytes_per_block(model, 4, torch.bfloat16) == 4 * (2 * 2 * 8 * 2 + 13 * 2 + 5 * 4)


def test_allocation_follows_each_spec_and_binds_it():
    model = _model()
    caches = allocate_kv_cache(model, 6, 4, torch.bfloat16, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 6, 4, 2, 8), (6, 4, 13), (6, 4, 5)]
    assert [c.dtype for c in caches] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert all(layer.kv_cache is c for layer, c in zip(cache_layers(model), caches))


@pytest.mark.parametrize("shape, block_dim", [((), 0), ((4, 0), 0), ((4,), 2)])
def test_bad_specs_are_refused(shape, block_dim):
    with pytest.raises(ValueError, match="cache"):
        KVCacheSpec("x", shape, block_dim=block_dim)
