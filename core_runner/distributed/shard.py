"""Which part of a weight, of the attention heads and of the vocabulary a rank owns.

Pure arithmetic: the layers in `models/layers/parallel_linear.py` size their parameters with it
and narrow each checkpoint tensor to their rank's part before copying it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a dimension of length `total`."""

    start: int
    size: int
    total: int

    def narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's part of a checkpoint tensor, as a view: a tensor mapped from a
        safetensors file is read only where the copy into the parameter touches it."""
        if tensor.shape[dim] != self.total:
            raise ValueError(f"dimension {dim} of shape {tuple(tensor.shape)} is not {self.total}")
        return tensor.narrow(dim, self.start, self.size)


def even_shard(total: int, rank: int, world_size: int, what: str) -> Shard:
    """`total` split in equal parts; ValueError naming `what` when it does not divide."""
    if total % world_size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={world_size}")
    size = total // world_size
    return Shard(rank * size, size, total)


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: query heads split evenly; KV heads split evenly, or, with
    fewer KV heads than ranks, each rank keeps one KV head shared by `kv_replicas` ranks."""

    q: Shard  # in heads
    kv: Shard  # in heads
    kv_replicas: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    q = even_shard(num_heads, rank, world_size, "num_attention_heads")
    if num_kv_heads >= world_size:
        return HeadShard(q, even_shard(num_kv_heads, rank, world_size, "num_key_value_heads"), 1)
    if world_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is fewer than tensor_parallel_size={world_size} and does not divide "
            "it: each KV head must be replicated on a whole number of ranks"
        )
    replicas = world_size // num_kv_heads
    return HeadShard(q, Shard(rank // replicas, 1, num_kv_heads), replicas)


def check_head_split(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """ValueError (saying what to change) when the heads cannot be split over `world_size`."""
    head_shard(num_heads, num_kv_heads, 0, world_size)


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> Shard:
    """A rank's rows of the vocabulary: ceil(vocab / world_size) each, the last rank's part
    ending at the vocabulary (its table is padded to the common size)."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return Shard(start, min(per_rank, vocab_size - start), vocab_size)
