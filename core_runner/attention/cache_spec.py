"""What a layer keeps in the paged KV blocks, declared by the layer; the runner sizes and
allocates from it.

A layer that caches entries per token in KV blocks subclasses `PagedCacheLayer` and returns a
`KVCacheSpec` from `kv_cache_spec()`: a kind (for messages), the shape of one token's entries
and their dtype. The runner allocates one tensor of `spec.cache_shape(num_blocks, block_size)`
per layer and binds it as the layer's `kv_cache`; block-count sizing sums
`spec.bytes_per_block` over the layers. Full attention declares K and V per KV head; multi-head
latent attention (models/layers/mla_attention.py) one compressed latent plus a rotary key. The
runner never looks at the kind: a new layout is a new spec, not a case in core_runner.

A spec also says how far back the layer reads (`sliding_window`): layers with equal specs form a
KV-cache group (runner/kv_cache.py) with its own block table per request, and a sliding-window
group's blocks leave once every later query is past them (engine/block_manager.py).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's entries per token. The cache tensor is `shape_per_token` with the paged dims
    [num_blocks, block_size] inserted before dim `block_dim`: full attention's (2, kv_heads,
    head_dim) with block_dim 1 is [2, num_blocks, block_size, kv_heads, head_dim] (K and V
    planes); an MLA latent (rank + rope,) with block_dim 0 is [num_blocks, block_size, rank + rope]."""

    kind: str  # what the entries are, for messages: "kv", "mla_latent"
    shape_per_token: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the engine's KV-cache dtype (the model's, or fp8)
    block_dim: int = 0
    # Whether the layer's kernels read this cache in float8 e4m3 (kv_cache_dtype="fp8"); a
    # layer that cannot makes the engine refuse fp8, naming its kind.
    supports_fp8: bool = False
    # The layer's queries read only keys with q_pos - k_pos < sliding_window (AttentionSpec's
    # convention); None: every earlier key. Blocks wholly before a request's window may be freed.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.shape_per_token or any(int(d) <= 0 for d in self.shape_per_token):
            raise ValueError(f"{self.kind} cache: shape per token {self.shape_per_token} must be non-empty and positive")
        if not 0 <= self.block_dim <= len(self.shape_per_token):
            raise ValueError(f"{self.kind} cache: block_dim {self.block_dim} outside shape {self.shape_per_token}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.kind} cache: sliding_window must be >= 1 or None, got {self.sliding_window}")

    def dtype_for(self, engine_dtype: torch.dtype) -> torch.dtype:
        return engine_dtype if self.dtype is None else self.dtype

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        s, d = self.shape_per_token, self.block_dim
        return (*s[:d], num_blocks, block_size, *s[d:])

    def bytes_per_block(self, block_size: int, engine_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=self.dtype_for(engine_dtype)).element_size()
        return block_size * math.prod(self.shape_per_token) * elem


class PagedCacheLayer(nn.Module, abc.ABC):
    """Base of every layer whose per-token state lives in KV blocks. The runner finds these
    layers in the model, allocates `kv_cache_spec()`'s tensor for each and binds it to
    `kv_cache` once, before the first forward."""

    kv_cache: torch.Tensor | None
    # Which KV-cache group's block table this layer's slots and block ids come from; bound by the
    # runner with `kv_cache` (0 while the model has one group).
    kv_group: int = 0
    # Whether a step whose rows carry several query tokens each (speculative drafts) may be
    # captured in a CUDA graph: False for a layer that lays such rows out from host-side
    # metadata (lengths read on the host, a loop over rows), which a replay would not update.
    multi_token_rows_in_graphs: bool = True

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer keeps per token (constant for the layer's lifetime)."""


def multi_token_rows_capturable(model: nn.Module) -> bool:
    """Whether steps whose rows carry several query tokens may be captured for `model`: every
    paged layer allows it (`PagedCacheLayer.multi_token_rows_in_graphs`)."""
    return all(m.multi_token_rows_in_graphs for m in model.modules() if isinstance(m, PagedCacheLayer))
