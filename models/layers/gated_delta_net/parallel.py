"""Tensor parallelism for the gated delta-net: key heads, and the value heads they serve, split by rank.

Each rank keeps num_k_heads / world_size key heads and the num_v_heads / world_size value heads
that read them (value head h reads key head h // (num_v_heads // num_k_heads), so a rank's value
heads are consecutive and follow its key heads). It holds their rows of every input projection,
their channels of the depthwise conv over [q | k | v], their `A_log` / `dt_bias`, and the
matching columns of `out_proj` (row-parallel: the ranks' outputs are all-reduced). The head
norm's weight (one head's width) is whole on every rank. A slot's conv window and matrix state
hold only the rank's channels and heads (the layer's state spec is sized from `rank_args`).

Qwen3-Next's fused projections are grouped per key head ([q | k | v | z] and [b | a] of each
key head's group, back to back), so a rank's part is one contiguous block of rows; Qwen3.5's
`in_proj_qkv` is [q | k | v] of all heads, so each part is narrowed on its own.

At tensor_parallel_size 1 the factories build the plain layers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from torch import nn

from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, current_tp
from slotrunner.core_runner.distributed.shard import Shard, even_shard
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.mamba.parallel import ChannelShardedConv1d
from slotrunner.models.layers.parallel_linear import MergedColumnParallelLinear, column_linear


class DeltaNetShards(NamedTuple):
    tp: TensorParallelGroup
    k_heads: Shard  # of num_k_heads
    v_heads: Shard  # of num_v_heads


def check_delta_net_split(num_k_heads: int, num_v_heads: int, world_size: int) -> None:
    """ValueError when a delta-net's key or value heads cannot be split over `world_size` ranks."""
    even_shard(num_k_heads, 0, world_size, "linear_num_key_heads")
    even_shard(num_v_heads, 0, world_size, "linear_num_value_heads")


def delta_net_shards(num_k_heads: int, num_v_heads: int) -> DeltaNetShards:
    tp = current_tp()
    check_delta_net_split(num_k_heads, num_v_heads, tp.world_size)
    k_heads = even_shard(num_k_heads, tp.rank, tp.world_size, "linear_num_key_heads")
    return DeltaNetShards(tp, k_heads, even_shard(num_v_heads, tp.rank, tp.world_size, "linear_num_value_heads"))


def rank_args(args, shards: DeltaNetShards):  # GatedDeltaNetArgs -> the rank's GatedDeltaNetArgs
    return dataclasses.replace(args, num_k_heads=shards.k_heads.size, num_v_heads=shards.v_heads.size)


def _scaled(s: Shard, k: int) -> Shard:
    return Shard(s.start * k, s.size * k, s.total * k)


def conv_parts(args, shards: DeltaNetShards) -> list[Shard]:
    """The rank's channels of each part of the conv's input [q | k | v] (args: the whole layer's)."""
    key = _scaled(shards.k_heads, args.head_k_dim)
    return [key, key, _scaled(shards.v_heads, args.head_v_dim)]


def grouped_linear(args, out_per_k_head: int) -> Linear:
    """A fused projection grouped per key head (Qwen3-Next's in_proj_qkvz, in_proj_ba): the
    rank's key heads' groups are one block of rows, so an even split of the rows is theirs."""
    return column_linear(args.hidden_size, args.num_k_heads * out_per_k_head, bias=False)


def qkv_in_proj(args, shards: DeltaNetShards) -> Linear:
    """Qwen3.5's in_proj_qkv ([q | k | v] of all heads): the rank's heads of each part."""
    if shards.tp.world_size == 1:
        return Linear(args.hidden_size, args.conv_dim, bias=False)
    q, k, v = conv_parts(args, shards)
    return MergedColumnParallelLinear(args.hidden_size, {"q": q, "k": k, "v": v}, False, shards.tp)


def conv1d(args, shards: DeltaNetShards) -> nn.Conv1d:
    a = args
    if shards.tp.world_size == 1:
        return nn.Conv1d(a.conv_dim, a.conv_dim, a.conv_kernel, groups=a.conv_dim, bias=False)
    return ChannelShardedConv1d(conv_parts(a, shards), a.conv_kernel, bias=False)
