"""The paged KV cache: layers grouped by what they cache, tensors shared by the groups, bound once.

Every `PagedCacheLayer` in the model declares its entries per token (`KVCacheSpec`: full
attention's K and V per KV head, an MLA latent, ...) and how far back it reads (its sliding
window); the cache is sized and allocated from those specs alone, so a new layout needs no
change here.

KV-cache groups (vLLM's hybrid KV-cache manager). A model whose layers all cache the same way
is one group: every layer gets its own tensor and a block id means "this block of every layer".
A model mixing full-attention and sliding-window layers with otherwise equal entries is split into groups of equal size G, each of one window: a request then holds one
block list per group, and a sliding-window group's list drops the blocks its window has passed
(core_runner/engine/block_manager.py). All groups draw block ids from one pool: shared KV
tensor j holds the j-th layer of every group, so block b of group g is page b of the tensors of
g's layers. A block id thus costs G layers' pages, whichever group holds it. G is the fewest
layers sharing a window, or the most when the counts are within 25% (vLLM's rule): 5 sliding
layers to 1 full make groups of the full layers' count; a group left short wastes the
pages of the tensors it leaves unused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from slotrunner.core_runner.attention.cache_spec import KVCacheSpec, PagedCacheLayer

logger = logging.getLogger(__name__)

# The block a sliding-window group's table names where the request holds none (out of its
# window): never handed out by the block manager (engine/block_manager.py), zeroed here and never
# written, so a kernel reading a masked position there reads zeros, which contribute exactly 0.
NULL_BLOCK = 0


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


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose block ids come from one block table per request."""

    sliding_window: int | None  # every layer's window; None: full attention (no block ever leaves early)
    layers: tuple[PagedCacheLayer, ...]  # layer j of the group uses shared tensor j


@dataclass(frozen=True)
class KVCacheLayout:
    """How the model's caching layers share block ids: its groups, in the order the block
    manager and the block tables number them (full attention first)."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def num_tensors(self) -> int:
        return max((len(g.layers) for g in self.groups), default=0)

    def tensor_specs(self) -> list[KVCacheSpec]:
        """The spec of each shared tensor: that of the first group's layer there (groups of more
        than one share slots only when their layers' specs differ in the window alone)."""
        specs: list[KVCacheSpec] = []
        for g in self.groups:
            specs += [layer.kv_cache_spec() for layer in g.layers[len(specs) :]]
        return specs

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id costs: a page of every shared tensor (`dtype`: the KV-cache dtype,
        for specs that leave theirs open)."""
        return sum(spec.bytes_per_block(block_size, dtype) for spec in self.tensor_specs())

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Allocate the shared tensors and bind each layer to its tensor and group; returns them.
        With a sliding-window group, NULL_BLOCK is zeroed in each."""
        caches = []
        zero_null = any(w is not None for w in self.windows)
        for spec in self.tensor_specs():
            # Uninitialised on purpose: every position is written before it is read (a row reads only
            # its first seq_len positions), and untouched pages of a large CPU cache cost nothing. A
            # sliding-window row's table still names blocks it freed, at positions its window
            # masks: they hold K/V some request wrote (a block is freed only once written whole),
            # and NULL_BLOCK where it never held one.
            cache = torch.empty(spec.cache_shape(num_blocks, block_size), dtype=spec.dtype_for(dtype), device=device)
            if zero_null:
                cache.select(spec.block_dim, NULL_BLOCK).zero_()
            caches.append(cache)
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                layer.kv_cache, layer.kv_group = caches[j], g
        return caches


def kv_cache_layout(model: nn.Module, hybrid: bool = True) -> KVCacheLayout:
    """Group the model's caching layers. `hybrid=False` (vLLM's disable_hybrid_kv_cache_manager)
    keeps one group: its window is the layers' common window if they share one (blocks still
    leave the window), else None (sliding-window layers then hold every block)."""
    layers = cache_layers(model)
    specs = [layer.kv_cache_spec() for layer in layers]
    windows = {s.sliding_window for s in specs}
    common = next(iter(windows)) if len(windows) == 1 else None
    single = KVCacheLayout((KVCacheGroup(common, tuple(layers)),))
    if not hybrid or len(windows) <= 1:
        return single
    if len({replace(s, sliding_window=None) for s in specs}) > 1:
        logger.info("KV-cache groups off: the caching layers differ in more than their window; every layer keeps every block")
        return single
    by_window: dict[int | None, list[PagedCacheLayer]] = {}
    for layer, spec in zip(layers, specs):
        by_window.setdefault(spec.sliding_window, []).append(layer)
    counts = [len(v) for v in by_window.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):  # full attention first
        members = by_window[window]
        groups += [KVCacheGroup(window, tuple(members[i : i + size])) for i in range(0, len(members), size)]
    return KVCacheLayout(tuple(groups))


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all caching layers (one group), from each layer's declared
    spec (`dtype`: the KV-cache dtype, for specs that leave theirs open)."""
    return kv_cache_layout(model, hybrid=False).bytes_per_block(block_size, dtype)


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Allocate each layer's cache (one group) and bind it to the layer; returns them in layer order."""
    return kv_cache_layout(model, hybrid=False).allocate(num_blocks, block_size, dtype, device)
