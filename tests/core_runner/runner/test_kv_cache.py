"""The KV cache is sized and allocated from the specs the layers declare, in KV-cache groups.

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
from slotrunner.core_runner.runner.kv_cache import (
    NULL_BLOCK,
    allocate_kv_cache,
    cache_layers,
    kv_bytes_per_block,
    kv_cache_layout,
)


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


# -- KV-cache groups -------------------------------------------------------------------------

def _attention_stack(windows: list[int | None], head_dim: int = 8) -> nn.Module:
    return nn.ModuleList(
        Attention(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=head_dim, scale=1.0, sliding_window=w), i)
        for i, w in enumerate(windows)
    )


def test_gemma3_pattern_groups_by_window_in_groups_of_the_full_layers_count():
    """Guards against groups that waste memory: Gemma 3's 5 sliding : 1 full in 12 layers makes 6
    groups of 2 layers (2 shared tensors), so a block id costs 2 layers' pages, not 12; and
    against a layer bound to another group's table or to a tensor of another shape."""
    model = _attention_stack(([7] * 5 + [None]) * 2)
    layout = kv_cache_layout(model)
    assert layout.windows == (None, 7, 7, 7, 7, 7)
    assert [len(g.layers) for g in layout.groups] == [2] * 6
    page = 4 * 2 * 2 * 8 * 4  # block_size 4, K and V, 2 KV heads of 8, float32
    assert layout.bytes_per_block(4, torch.float32) == 2 * page
    caches = layout.allocate(5, 4, torch.float32, torch.device("cpu"))
    assert len(caches) == 2 and all(tuple(c.shape) == (2, 5, 4, 2, 8) for c in caches)
    for g, group in enumerate(layout.groups):
        for j, layer in enumerate(group.layers):
            assert layer.kv_group == g and layer.kv_cache is caches[j]
    assert all(not c[:, NULL_BLOCK].any() for c in caches), "NULL_BLOCK is zeroed"


def test_near_equal_counts_pad_one_group_instead_of_splitting():
    """vLLM's 1.25 rule: 12 sliding + 13 full layers make two groups of 13 slots (one empty),
    not a group of 12 and a second full group of 1 padded to 12."""
    layout = kv_cache_layout(_attention_stack([5] * 12 + [None] * 13))
    assert layout.windows == (None, 5) and layout.num_tensors == 13


def test_one_group_when_off_uniform_or_unequal():
    """`hybrid=False` (disable_hybrid_kv_cache_manager), a window shared by every layer, or
    layers whose caches differ beyond the window: one group. Its window is the common one (the
    blocks of a model that slides everywhere still leave), else None (every block kept)."""
    mixed = _attention_stack([7, None, 7, None])
    off = kv_cache_layout(mixed, hybrid=False)
    assert off.windows == (None,) and off.num_tensors == 4
    assert off.bytes_per_block(4, torch.float32) == kv_bytes_per_block(mixed, 4, torch.float32)
    assert kv_cache_layout(_attention_stack([7, 7, 7])).windows == (7,)
    unequal = nn.ModuleList([*_attention_stack([7, 7]), *_attention_stack([None], head_dim=16)])
    assert kv_cache_layout(unequal).windows == (None,)
