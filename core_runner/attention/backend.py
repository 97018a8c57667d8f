"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Common attention metadata of one step (self-attention over the paged KV cache)."""

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    query_start_loc_np: np.ndarray  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] int32, KV length of each row after this step's writes
    seq_lens_np: np.ndarray  # [num_reqs]
    max_query_len: int
    max_seq_len: int
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new K/V goes in the flat cache
    # [1] int32, or None: the first keys of every row of a decode-only batch, which every row
    # reads through the same cache blocks (row 0's table names them): a prefix that prefix
    # caching shares. A backend with `shared_prefix_granule` reads them once for many rows; any
    # other attends as usual, to the same result.
    shared_prefix_len: torch.Tensor | None = None
    # [num_reqs] int32, or None: the rows by decreasing length (seq_lens), a permutation. A
    # backend may start the programs of long rows first (TileConfig.decode_longest_first); a
    # row's result does not depend on it.
    decode_order: torch.Tensor | None = None

    @classmethod
    def for_capture(
        cls,
        n: int,  # rows
        q: int,  # tokens a row
        max_model_len: int,
        query_start_loc: torch.Tensor,  # [>= n + 1] persistent buffers the graph reads; sliced here
        seq_lens: torch.Tensor,  # [>= n]
        block_tables: torch.Tensor,  # [>= n, max_num_blocks_per_req]
        slot_mapping: torch.Tensor,  # [>= n * q]
        shared_prefix_len: torch.Tensor | None = None,  # [1]: a capture of decode steps with a shared prefix
        decode_order: torch.Tensor | None = None,  # [>= n]
    ) -> AttentionMetadata:
        """Metadata of a CUDA-graph capture over the first n rows and n * q tokens of persistent
        buffers. Host-side fields are upper bounds: the captured kernels read each row's real
        query and length from the buffers, rewritten before every replay."""
        return cls(
            num_reqs=n,
            num_tokens=n * q,
            query_start_loc=query_start_loc[: n + 1],
            query_start_loc_np=np.arange(n + 1) * q,
            seq_lens=seq_lens[:n],
            seq_lens_np=np.full(n, max_model_len),
            max_query_len=q,
            max_seq_len=max_model_len,
            block_tables=block_tables[:n],
            slot_mapping=slot_mapping[: n * q],
            shared_prefix_len=shared_prefix_len,
            decode_order=None if decode_order is None else decode_order[:n],
        )


@dataclass(frozen=True)
class FamilyAttnMetadata:
    """Base for family attention metadata that the common attention metadata lacks
    (cross-attention lengths, recurrent-state prefill flags and indices). A family's ModelState builds it
    in `prepare_attn`; the family's layers read it from the forward context as `ctx.family_attn`."""


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer is: the backend needs nothing else about the model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query attends to keys with q_pos - k_pos < sliding_window
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Layout of one layer's paged cache: K and V, each [num_blocks, block_size, heads, dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


# A layer's rotary embedding (with its per-head norms), handed to the backend with q and k before
# it: rotate(q, k, kv) -> (q, k). `kv`, when not None, is the backend's K/V write of the step
# (TritonBackend's `KVWrite`, kv_write.py), which rotate must perform -- with its own launch's stores where it
# can (models/layers/rotary_qk.py), else by calling `kv.write(k)` on the rotated k.
Rotate = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(abc.ABC):
    """Causal self-attention over a paged KV cache for varlen batches mixing prefill and decode."""

    name: str = "abstract"
    # Tokens: a backend that reads a decode batch's shared prefix once for many rows
    # (AttentionMetadata.shared_prefix_len) takes prefixes that are a multiple of this; None: it
    # has no such launch, and the runner never computes the prefix for it.
    shared_prefix_granule: int | None = None
    # Whether the backend reads AttentionMetadata.decode_order (its decode launch starts long rows
    # first); the runner stages the order only for one that does.
    orders_decode_rows: bool = False

    @abc.abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        meta: AttentionMetadata,
        position_bias: torch.Tensor | None = None,  # [num_heads, num_distances]
        sinks: torch.Tensor | None = None,  # [num_heads]
        rotate: Rotate | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into the cache at `meta.slot_mapping`, then attend each query
        token to its request's keys at positions <= its own (within the sliding window).

        `rotate`, when given, means q and k come before the layer's rotary embedding: the backend
        applies it first (`Rotate`), handing it the K/V write where it has a launch to fuse it into.

        `position_bias`, when given, is added to the scaled score of a query at q_pos and a key
        at k_pos: `position_bias[:, min(q_pos - k_pos, num_distances - 1)]` (relative-position
        biases such as T5's, or ALiBi slopes times distance, tabulated by distance).

        `sinks`, when given, are per-head logits that join each query's softmax as one more key
        with a zero value (GPT-OSS's attention sinks): they take probability mass, add nothing."""


FP8_MAX = 448.0  # largest finite float8 e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V as the cache keeps them. Float8 e4m3 (kv_cache_dtype="fp8", scale 1 as vLLM's
    default): round to nearest even after saturating at +-448, the conversion the Triton write
    kernel makes, so both write the same bytes."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def copy_into_cache(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots] = rows, converted to the cache's dtype as `to_cache_dtype` does (the torch
    reference of every cache write: K/V here, MLA's latents in models/layers/mla_decode.py)."""
    rows = to_cache_dtype(rows, flat.dtype)
    if flat.dtype.itemsize == 1:  # index_copy_ has no float8 kernel: copy the bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store K/V of `num_tokens` tokens at flat cache slots (block_id * block_size + offset)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    copy_into_cache(flat[0], slot_mapping, k)
    copy_into_cache(flat[1], slot_mapping, v)
