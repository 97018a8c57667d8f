"""Tensor parallelism for the Mamba2 mixer: heads (and their state) split by rank.

Each rank keeps num_heads / world_size heads: their rows of z, x and dt in `in_proj`, their
channels of the depthwise conv, their `dt_bias` / `A_log` / `D`, their slice of the gated norm,
their columns of `out_proj` (row-parallel: the ranks' outputs are all-reduced). The B and C
groups are split with the heads when n_groups divides over the ranks (each group's heads stay on
the rank that holds the group); with one group, every rank keeps B and C whole and the gated
norm, whose one group then spans every rank, all-reduces its sum of squares. The conv window and
the SSM state of a slot hold only the rank's channels and heads (the layer's state spec is sized
from the rank's `Mamba2MixerArgs`).

`mixer_shards` gives SINGLE-rank shards (everything) at tensor_parallel_size 1, and the
factories then build the plain layers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, current_tp
from slotrunner.core_runner.distributed.shard import Shard, even_shard
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.mamba.gated_norm import GatedRMSNorm
from slotrunner.models.layers.parallel_linear import MergedColumnParallelLinear, ShardedWeights


class MixerShards(NamedTuple):
    tp: TensorParallelGroup
    heads: Shard  # of num_heads
    groups: Shard  # of n_groups (whole, replicated, when there is one group and several ranks)


def check_mixer_split(num_heads: int, n_groups: int, world_size: int) -> None:
    """ValueError when a mixer's heads or groups cannot be split over `world_size` ranks."""
    even_shard(num_heads, 0, world_size, "mamba num_heads")
    if n_groups != 1 and n_groups % world_size:
        raise ValueError(
            f"mamba n_groups={n_groups} must be 1 (B and C kept whole on every rank) or divisible by "
            f"tensor_parallel_size={world_size}"
        )


def mixer_shards(num_heads: int, n_groups: int) -> MixerShards:
    tp = current_tp()
    check_mixer_split(num_heads, n_groups, tp.world_size)
    heads = even_shard(num_heads, tp.rank, tp.world_size, "mamba num_heads")
    groups = Shard(0, 1, 1) if n_groups == 1 else even_shard(n_groups, tp.rank, tp.world_size, "mamba n_groups")
    return MixerShards(tp, heads, groups)


def rank_args(args, shards: MixerShards):  # Mamba2MixerArgs -> the rank's Mamba2MixerArgs
    d = args.head_dim
    return dataclasses.replace(
        args, intermediate_size=shards.heads.size * d, num_heads=shards.heads.size, n_groups=shards.groups.size
    )


def _scaled(s: Shard, k: int) -> Shard:
    return Shard(s.start * k, s.size * k, s.total * k)


def in_proj_parts(args, shards: MixerShards) -> dict[str, Shard]:
    """The rank's rows of each part of in_proj's output [z | x | B | C | dt]."""
    inner, group = _scaled(shards.heads, args.head_dim), _scaled(shards.groups, args.state_size)
    return {"z": inner, "x": inner, "B": group, "C": group, "dt": shards.heads}


def in_proj_rows(vector: torch.Tensor, args, shards: MixerShards) -> torch.Tensor:
    """The rank's entries of a per-feature vector over in_proj's output (FalconH1's mup scale)."""
    pieces, start = [], 0
    for part in in_proj_parts(args, shards).values():
        pieces.append(part.narrow(vector.narrow(0, start, part.total), 0))
        start += part.total
    return torch.cat(pieces)


def in_proj(args, shards: MixerShards) -> Linear:
    """[z | x | B | C | dt] from the hidden state: the rank's rows of each part."""
    a, tp = args, shards.tp
    if tp.world_size == 1:
        return Linear(a.hidden_size, a.intermediate_size + a.conv_dim + a.num_heads, bias=a.use_bias)
    return MergedColumnParallelLinear(a.hidden_size, in_proj_parts(a, shards), a.use_bias, tp)


class ChannelShardedConv1d(nn.Conv1d, ShardedWeights):
    """The depthwise conv over [x | B | C], holding the rank's channels of each part."""

    def __init__(self, parts: list[Shard], kernel: int, bias: bool) -> None:
        channels = sum(p.size for p in parts)
        super().__init__(channels, channels, kernel, groups=channels, bias=bias)
        self.parts = parts

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        pieces, start = [], 0
        for part in self.parts:
            pieces.append(part.narrow(tensor.narrow(0, start, part.total), 0))
            start += part.total
        if start != tensor.shape[0]:
            raise ValueError(f"shape {tuple(tensor.shape)} does not have the {start} conv channels of x, B and C")
        param = getattr(self, param_name)
        with torch.no_grad():
            param.copy_(torch.cat(pieces))


def conv1d(args, shards: MixerShards) -> nn.Conv1d:
    a = args
    if shards.tp.world_size == 1:
        return nn.Conv1d(a.conv_dim, a.conv_dim, a.conv_kernel, groups=a.conv_dim, bias=a.use_conv_bias)
    group = _scaled(shards.groups, a.state_size)
    return ChannelShardedConv1d([_scaled(shards.heads, a.head_dim), group, group], a.conv_kernel, a.use_conv_bias)


class ParallelGatedRMSNorm(GatedRMSNorm, ShardedWeights):
    """The gated norm over the rank's heads; a group spread over the ranks (one group, several
    ranks) has its sum of squares all-reduced, so every rank divides by the whole group's."""

    def __init__(self, rows: Shard, group_size: int, eps: float, tp: TensorParallelGroup) -> None:
        self.spans_ranks = group_size > rows.size
        super().__init__(rows.size, rows.size if self.spans_ranks else group_size, eps)
        self.rows, self.tp, self.full_group = rows, tp, group_size

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(self.rows.narrow(tensor, 0))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [num_tokens, rank's rows]
        if not self.spans_ranks:
            return super().forward(x, gate)
        h = x.float() * torch.nn.functional.silu(gate.float())
        sum_sq = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(sum_sq / self.full_group + self.eps)
        return self.weight * h.to(x.dtype)


def gated_norm(args, shards: MixerShards) -> GatedRMSNorm:
    a = args
    if shards.tp.world_size == 1:
        return GatedRMSNorm(a.intermediate_size, a.intermediate_size // a.n_groups, a.norm_eps)
    rows = _scaled(shards.heads, a.head_dim)
    return ParallelGatedRMSNorm(rows, a.intermediate_size // a.n_groups, a.norm_eps, shards.tp)
