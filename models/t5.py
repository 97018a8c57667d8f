"""T5 (T5ForConditionalGeneration): relative position bias, RMS norms, no attention scaling.

The first layer of each stack owns the learned relative position bias and every layer of the
stack adds it. In the encoder it is a dense [heads, n, n] matrix over one request; the decoder
attends over the paged cache and hands the backend a table by distance instead. v1.0 checkpoints
(tied head) scale the decoder output by d_model**-0.5 before the head: `scale_decoder_outputs`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.distributed.shard import Shard, even_shard
from slotrunner.models.layers.cross_attention import CrossAttention
from slotrunner.models.layers.dense_attention import dense_attention
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.lm_head import vocab_logits
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.parallel_linear import ShardedWeights, column_linear, query_heads, row_linear
from slotrunner.models.layers.relative_position import BiasedAttention, RelativePositionBias
from slotrunner.models.layers.weight_aliases import resolve_aliases, share_equal_parameters
from slotrunner.models.weights import WeightLoader


@dataclass(frozen=True)
class T5Args:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    num_buckets: int
    max_distance: int
    eps: float
    activation: str
    gated: bool
    scale_decoder_outputs: bool

    @classmethod
    def from_hf(cls, c: object) -> T5Args:
        act_info = c.feed_forward_proj.split("-")
        activation = getattr(c, "dense_act_fn", None) or act_info[-1]
        scale = getattr(c, "scale_decoder_outputs", None)
        if scale is None:  # transformers before 5.2x scaled exactly when the head was tied
            scale = bool(getattr(c, "tie_word_embeddings", True))
        return cls(
            vocab_size=c.vocab_size,
            d_model=c.d_model,
            d_kv=c.d_kv,
            d_ff=c.d_ff,
            num_heads=c.num_heads,
            num_layers=c.num_layers,
            num_decoder_layers=c.num_decoder_layers or c.num_layers,
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance,
            eps=c.layer_norm_epsilon,
            activation="gelu_new" if c.feed_forward_proj == "gated-gelu" else activation,
            gated=act_info[0] == "gated",
            scale_decoder_outputs=bool(scale),
        )

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv


class _Projections(nn.Module):
    def __init__(self, a: T5Args, sharded: bool = False) -> None:
        super().__init__()
        self.num_heads, self.d_kv = a.num_heads, a.d_kv
        if not sharded:  # the encoder: replicated on every rank under tensor parallelism
            self.q = nn.Linear(a.d_model, a.inner_dim, bias=False)
            self.k = nn.Linear(a.d_model, a.inner_dim, bias=False)
            self.v = nn.Linear(a.d_model, a.inner_dim, bias=False)
            self.o = nn.Linear(a.inner_dim, a.d_model, bias=False)
            return
        # The decoder: this rank's heads (all of them at tensor_parallel_size 1); `o` sums the ranks'.
        self.heads = query_heads(a.num_heads, a.num_heads)
        self.num_heads = self.heads.size
        self.q = column_linear(a.d_model, a.inner_dim, bias=False)
        self.k = column_linear(a.d_model, a.inner_dim, bias=False)
        self.v = column_linear(a.d_model, a.inner_dim, bias=False)
        self.o = row_linear(a.inner_dim, a.d_model, bias=False)


class _RankRelativePositionBias(RelativePositionBias, ShardedWeights):
    """The decoder's bias table, by the rank's heads (its columns of [num_buckets, num_heads])."""

    def __init__(self, num_buckets: int, max_distance: int, heads: Shard) -> None:
        super().__init__(num_buckets, max_distance, heads.size, bidirectional=False)
        self.heads = heads

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(self.heads.narrow(tensor, 1))


class T5EncoderAttention(_Projections):
    def __init__(self, a: T5Args, has_bias: bool) -> None:
        super().__init__(a)
        if has_bias:
            self.relative_attention_bias = RelativePositionBias(a.num_buckets, a.max_distance, a.num_heads, bidirectional=True)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # [n, d_model], [heads, n, n]
        shape = (x.shape[0], self.num_heads, self.d_kv)
        q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
        return self.o(dense_attention(q, k, v, 1.0, bias))  # T5 folds the scale into its weights


class T5DecoderAttention(_Projections):
    def __init__(self, a: T5Args, has_bias: bool, layer_idx: int) -> None:
        super().__init__(a, sharded=True)
        if has_bias:
            self.relative_attention_bias = _RankRelativePositionBias(a.num_buckets, a.max_distance, self.heads)
        self.attn = BiasedAttention(AttentionSpec(self.num_heads, self.num_heads, a.d_kv, 1.0), layer_idx)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # [num_tokens, d_model], [heads, distances]
        return self.o(self.attn(self.q(x), self.k(x), self.v(x), bias))


class T5CrossAttention(_Projections):
    def __init__(self, a: T5Args) -> None:
        super().__init__(a, sharded=True)
        self.attn = CrossAttention(self.num_heads, self.num_heads, a.d_kv, 1.0)

    def store(self, row: int, encoder_hidden: torch.Tensor) -> None:
        self.attn.store(row, self.k(encoder_hidden), self.v(encoder_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.attn(self.q(x)))


class T5DenseActDense(nn.Module):
    """act(wi x) or, gated, act(wi_0 x) * wi_1 x; then wo."""

    def __init__(self, a: T5Args, sharded: bool = False) -> None:
        super().__init__()
        self.gated = a.gated
        # The decoder's (`sharded`) is column- then row-parallel under tensor parallelism.
        inner = (lambda i, o: column_linear(i, o, bias=False)) if sharded else (lambda i, o: nn.Linear(i, o, bias=False))
        if a.gated:
            self.wi_0 = inner(a.d_model, a.d_ff)
            self.wi_1 = inner(a.d_model, a.d_ff)
        else:
            self.wi = inner(a.d_model, a.d_ff)
        self.wo = row_linear(a.d_ff, a.d_model, bias=False) if sharded else nn.Linear(a.d_ff, a.d_model, bias=False)
        self.act = hf_activation(a.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class _Sublayer(nn.Module):
    """Checkpoint layout `layer.{i}`: a norm and one of SelfAttention / EncDecAttention /
    DenseReluDense under its checkpoint name; x + f(norm(x))."""

    def __init__(self, a: T5Args, name: str, inner: nn.Module) -> None:
        super().__init__()
        self.layer_norm = RMSNorm(a.d_model, a.eps)
        self.name = name
        self.add_module(name, inner)

    @property
    def inner(self) -> nn.Module:
        return getattr(self, self.name)

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.layer_norm(x), *args)


class T5Block(nn.Module):
    def __init__(self, a: T5Args, is_decoder: bool, layer_idx: int) -> None:
        super().__init__()
        has_bias = layer_idx == 0
        if is_decoder:
            layers = [
                _Sublayer(a, "SelfAttention", T5DecoderAttention(a, has_bias, layer_idx)),
                _Sublayer(a, "EncDecAttention", T5CrossAttention(a)),
                _Sublayer(a, "DenseReluDense", T5DenseActDense(a, sharded=True)),
            ]
        else:
            layers = [
                _Sublayer(a, "SelfAttention", T5EncoderAttention(a, has_bias)),
                _Sublayer(a, "DenseReluDense", T5DenseActDense(a)),
            ]
        self.layer = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.layer[0](x, bias)
        for sub in self.layer[1:]:
            x = sub(x)
        return x


class T5Stack(nn.Module):
    def __init__(self, a: T5Args, is_decoder: bool) -> None:
        super().__init__()
        num_layers = a.num_decoder_layers if is_decoder else a.num_layers
        self.embed_tokens = nn.Embedding(a.vocab_size, a.d_model)
        self.block = nn.ModuleList(T5Block(a, is_decoder, i) for i in range(num_layers))
        self.final_layer_norm = RMSNorm(a.d_model, a.eps)

    @property
    def relative_bias(self) -> RelativePositionBias:
        return self.block[0].layer[0].SelfAttention.relative_attention_bias

    def run(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x, bias)
        return self.final_layer_norm(x)


class T5ForConditionalGeneration(nn.Module):
    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the decoder's heads or feed-forward cannot be split over `world_size`
        ranks (the decoder splits by head, its bias table too; the encoder, embeddings and head
        are replicated)."""
        a = T5Args.from_hf(hf_config)
        even_shard(a.num_heads, 0, world_size, "num_heads")
        even_shard(a.d_ff, 0, world_size, "d_ff")

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.args = T5Args.from_hf(hf_config)
        self.encoder = T5Stack(self.args, is_decoder=False)
        self.decoder = T5Stack(self.args, is_decoder=True)
        self.lm_head = Linear(self.args.d_model, self.args.vocab_size, bias=False)

    def encode(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, d_model]
        enc = self.encoder
        return enc.run(enc.embed_tokens(token_ids), enc.relative_bias.dense(token_ids.shape[0]))

    def store_cross_kv(self, row: int, encoder_hidden: torch.Tensor) -> None:
        for block in self.decoder.block:
            block.layer[1].EncDecAttention.store(row, encoder_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]; relative attention needs none beyond the cache's
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, d_model]
    ) -> torch.Tensor:  # [num_tokens, d_model]
        dec = self.decoder
        x = dec.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return dec.run(x, dec.relative_bias.by_distance())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, d_model] -> [rows, vocab]
        if self.args.scale_decoder_outputs:
            hidden = hidden * self.args.d_model**-0.5
        return vocab_logits(hidden, self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        enc, dec = "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"
        aliases = {
            enc: (enc, "shared.weight", dec),
            dec: (dec, "shared.weight", enc),
            "lm_head.weight": ("lm_head.weight", "shared.weight"),
        }
        # Old checkpoints carry a cross-attention bias that transformers ignores as well.
        loader = WeightLoader(self, ignore_unexpected=("EncDecAttention.relative_attention_bias.weight",))
        loaded = loader.load(resolve_aliases(weights, aliases))
        share_equal_parameters(self, [(enc, dec, "lm_head.weight")])
        return loaded
