"""Tensor-parallel layers: each rank holds its part of a weight and the forward adds the
collective that makes the layer's output whole again.

- `MergedColumnParallelLinear`: a fused projection (q/k/v, gate/up) whose every part is split
  by output rows; each rank computes its rows, no collective (the next row-parallel layer
  consumes them as they are).
- `RowParallelLinear`: split by input columns; each rank's partial product is summed over the
  ranks (all-reduce), then the bias is added once.
- `VocabParallelEmbedding`: each rank looks up the ids in its rows of the vocabulary and zeros
  elsewhere; the all-reduce leaves every rank the full embedding (one non-zero term each, so
  the sum is exact).
- `ParallelLMHead`: each rank's rows of the output matrix give its slice of the logits; the
  slices are gathered (the padding of the last rank dropped), so sampling sees the whole
  vocabulary on every rank. A head tied to a `VocabParallelEmbedding` gathers the same way.

Checkpoint tensors arrive whole (`WeightLoader` hands them to `load_full` / `load_shard`);
each layer narrows them to its rank's part before copying (`Shard.narrow`: a view, so a tensor
mapped from a safetensors file is read only where the copy touches it).

Models build their layers through the factories below, which read the group being built for
(`current_tp()`): at tensor_parallel_size 1 they return the plain layers of `linear.py`, so a
single-device model is exactly what it was.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, current_tp
from slotrunner.core_runner.distributed.shard import Shard, even_shard, head_shard, vocab_shard
from slotrunner.models.layers.linear import Linear, MergedLinear, VocabEmbedding, dense_linear


def _dense(tensor: torch.Tensor | PackedWeight) -> torch.Tensor:
    # A packed (GGUF) matrix cannot be narrowed in its blocks: a sharded layer keeps it dense.
    return tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor


class ShardedWeights:
    """A layer that takes whole checkpoint tensors and keeps its rank's part (`load_full`)."""

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        raise NotImplementedError


class MergedColumnParallelLinear(MergedLinear, ShardedWeights):
    """`MergedLinear` holding the rank's rows of every part (`parts`: name -> its `Shard` of
    the part's output rows). Parts arrive one by one (`load_shard`: q, k, v), or fused in the
    checkpoint's order in one tensor (`load_full`: Phi-3's qkv_proj, gate_up_proj)."""

    def __init__(self, in_features: int, parts: dict[str, Shard], bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, {name: s.size for name, s in parts.items()}, bias=bias)
        self.parts = parts
        self.tp = tp

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor | PackedWeight) -> None:
        part = self.parts[shard]
        super().load_shard(param_name, shard, part.narrow(_dense(tensor), 0))

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        tensor = _dense(tensor)
        total = sum(p.total for p in self.parts.values())
        if tensor.shape[0] != total:
            raise ValueError(f"shape {tuple(tensor.shape)} does not have the {total} fused rows of {list(self.parts)}")
        start = 0
        for name, part in self.parts.items():
            self.load_shard(param_name, name, tensor.narrow(0, start, part.total))
            start += part.total


class RowParallelLinear(Linear, ShardedWeights):
    """Linear over the rank's columns of the input (the output of a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        self.in_shard = even_shard(in_features, tp.rank, tp.world_size, "input features of a row-parallel linear")
        super().__init__(self.in_shard.size, out_features, bias=bias)
        self.tp = tp

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        tensor = _dense(tensor)
        if param_name == "weight":
            tensor = self.in_shard.narrow(tensor, 1)
        _copy(getattr(self, param_name), tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in / world] -> [tokens, out]
        y = self.tp.all_reduce(dense_linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallel:
    """A [vocab, hidden] table split by rows over the ranks (embedding, or output head)."""

    vocab_size: int
    vocab: Shard
    tp: TensorParallelGroup

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, per_rank] -> [rows, vocab]
        return self.tp.all_gather(logits)[..., : self.vocab_size]

    def _load_rows(self, weight: torch.Tensor, tensor: torch.Tensor | PackedWeight) -> None:
        rows = self.vocab.narrow(_dense(tensor), 0)
        if rows.shape[1:] != weight.shape[1:]:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match expected ({self.vocab_size}, {weight.shape[1]})")
        with torch.no_grad():
            weight[: rows.shape[0]].copy_(rows)
            weight[rows.shape[0] :].zero_()  # the last rank's padding rows


class VocabParallelEmbedding(VocabEmbedding, VocabParallel, ShardedWeights):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.vocab = vocab_shard(vocab_size, tp.rank, tp.world_size)
        super().__init__(-(-vocab_size // tp.world_size), hidden_size)

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        self._load_rows(self.weight, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear, VocabParallel, ShardedWeights):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.vocab = vocab_shard(vocab_size, tp.rank, tp.world_size)
        super().__init__(hidden_size, -(-vocab_size // tp.world_size), bias=False)

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        self._load_rows(self.weight, tensor)


def _copy(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"rank's part has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


# -- factories: plain layers at tensor_parallel_size 1, sharded ones above -----------------------


def qkv_linear(hidden_size: int, spec: AttentionSpec, bias: bool, q_rows_per_head: int = 1) -> MergedLinear:
    """The fused q/k/v projection of `spec`'s heads (whole, not this rank's: see `rank_spec`).
    `q_rows_per_head` head_dim blocks per query head in q's rows: 2 where q_proj also yields a
    per-head output gate (Qwen3-Next), which must stay on the rank of its head."""
    tp, d = current_tp(), spec.head_dim
    dq = q_rows_per_head * d
    if tp.world_size == 1:
        q, kv = spec.num_heads * dq, spec.num_kv_heads * d
        return MergedLinear(hidden_size, {"q": q, "k": kv, "v": kv}, bias=bias)
    heads = head_shard(spec.num_heads, spec.num_kv_heads, tp.rank, tp.world_size)
    q = Shard(heads.q.start * dq, heads.q.size * dq, spec.num_heads * dq)
    kv = Shard(heads.kv.start * d, heads.kv.size * d, spec.num_kv_heads * d)
    return MergedColumnParallelLinear(hidden_size, {"q": q, "k": kv, "v": kv}, bias, tp)


def query_heads(num_heads: int, num_kv_heads: int) -> Shard:
    """This rank's query heads (all of them at tensor_parallel_size 1), for per-head parameters."""
    tp = current_tp()
    return head_shard(num_heads, num_kv_heads, tp.rank, tp.world_size).q


def rank_spec(spec: AttentionSpec) -> AttentionSpec:
    """The heads this rank attends (and caches KV for) of a layer described by `spec`."""
    tp = current_tp()
    if tp.world_size == 1:
        return spec
    heads = head_shard(spec.num_heads, spec.num_kv_heads, tp.rank, tp.world_size)
    return dataclasses.replace(spec, num_heads=heads.q.size, num_kv_heads=heads.kv.size)


def merged_column_linear(in_features: int, shard_sizes: dict[str, int], bias: bool) -> MergedLinear:
    """A fused projection (gate/up) whose every part is split by output rows."""
    tp = current_tp()
    if tp.world_size == 1:
        return MergedLinear(in_features, shard_sizes, bias=bias)
    parts = {name: even_shard(size, tp.rank, tp.world_size, f"{name} projection rows") for name, size in shard_sizes.items()}
    return MergedColumnParallelLinear(in_features, parts, bias, tp)


def column_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """One projection split by output rows (a q, k or v of its own, an MLP's first layer)."""
    tp = current_tp()
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    rows = even_shard(out_features, tp.rank, tp.world_size, "output features of a column-parallel linear")
    return MergedColumnParallelLinear(in_features, {"rows": rows}, bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """A projection back to the hidden size from a column-parallel layer's output (o, down)."""
    tp = current_tp()
    return Linear(in_features, out_features, bias=bias) if tp.world_size == 1 else RowParallelLinear(in_features, out_features, bias, tp)


def vocab_embedding(vocab_size: int, hidden_size: int) -> VocabEmbedding:
    tp = current_tp()
    return VocabEmbedding(vocab_size, hidden_size) if tp.world_size == 1 else VocabParallelEmbedding(vocab_size, hidden_size, tp)


def output_head(embedding: VocabEmbedding) -> Linear:
    """The untied LM head matching `embedding`'s vocabulary (split the same way under TP)."""
    if isinstance(embedding, VocabParallelEmbedding):
        return ParallelLMHead(embedding.embedding_dim, embedding.vocab_size, embedding.tp)
    return Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
