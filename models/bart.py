"""BART (BartForConditionalGeneration), and the encoder/decoder blocks it shares with Whisper.

Both stack the same attention and feed-forward sublayers under the same checkpoint names; BART
normalises after each residual add (post-norm), Whisper before (pre-norm), and Whisper's key
projections have no bias. Those two flags are all that differ inside a layer.

An encoder runs once per request, outside the step's forward (`encode`, one unpadded
sequence); `store_cross_kv` writes each decoder layer's cross-attention K/V into the request's
slot. The step's forward runs only the decoder.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.core_runner.distributed.shard import even_shard
from slotrunner.models.layers.cross_attention import CrossAttention
from slotrunner.models.layers.dense_attention import dense_attention
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.lm_head import vocab_logits
from slotrunner.models.layers.parallel_linear import column_linear, query_heads, row_linear
from slotrunner.models.layers.weight_aliases import resolve_aliases, share_equal_parameters
from slotrunner.models.weights import WeightLoader


@dataclass(frozen=True)
class StackArgs:
    """One stack (encoder or decoder) of a BART-style model."""

    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    activation: str
    pre_norm: bool  # Whisper: x + f(norm(x)); BART: norm(x + f(x))
    k_bias: bool  # Whisper's k_proj has no bias

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of num_heads={self.num_heads}")


def stack_args(c: object, stack: str, pre_norm: bool, k_bias: bool) -> StackArgs:
    """`stack` is "encoder" or "decoder": the HF config names each stack's sizes by prefix."""
    return StackArgs(
        d_model=c.d_model,
        num_layers=getattr(c, f"{stack}_layers"),
        num_heads=getattr(c, f"{stack}_attention_heads"),
        ffn_dim=getattr(c, f"{stack}_ffn_dim"),
        activation=c.activation_function,
        pre_norm=pre_norm,
        k_bias=k_bias,
    )


class _Projections(nn.Module):
    def __init__(self, a: StackArgs, sharded: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = a.num_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        if not sharded:  # the encoder: replicated on every rank under tensor parallelism
            self.q_proj = nn.Linear(a.d_model, a.d_model)
            self.k_proj = nn.Linear(a.d_model, a.d_model, bias=a.k_bias)
            self.v_proj = nn.Linear(a.d_model, a.d_model)
            self.out_proj = nn.Linear(a.d_model, a.d_model)
            return
        # The decoder: this rank's heads (all of them at tensor_parallel_size 1); out_proj sums the ranks'.
        self.num_heads = query_heads(a.num_heads, a.num_heads).size
        self.q_proj = column_linear(a.d_model, a.d_model, bias=True)
        self.k_proj = column_linear(a.d_model, a.d_model, bias=a.k_bias)
        self.v_proj = column_linear(a.d_model, a.d_model, bias=True)
        self.out_proj = row_linear(a.d_model, a.d_model, bias=True)


class EncoderSelfAttention(_Projections):
    """Bidirectional attention over one request's encoder sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, d_model] -> [n, d_model]
        n = x.shape[0]
        shape = (n, self.num_heads, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        return self.out_proj(dense_attention(q, k, v, self.scale))


class DecoderSelfAttention(_Projections):
    """Causal attention over the paged KV cache."""

    def __init__(self, a: StackArgs, layer_idx: int) -> None:
        super().__init__(a, sharded=True)
        self.attn = Attention(AttentionSpec(self.num_heads, self.num_heads, a.head_dim, self.scale), layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, d_model]
        return self.out_proj(self.attn(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class DecoderCrossAttention(_Projections):
    """Attention to the request's encoder output, through its cache row of cross K/V."""

    def __init__(self, a: StackArgs) -> None:
        super().__init__(a, sharded=True)
        self.attn = CrossAttention(self.num_heads, self.num_heads, a.head_dim, self.scale)

    def store(self, row: int, encoder_hidden: torch.Tensor) -> None:  # [encoder_len, d_model]
        self.attn.store(row, self.k_proj(encoder_hidden), self.v_proj(encoder_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, d_model]
        return self.out_proj(self.attn(self.q_proj(x)))


def _sublayer(pre_norm: bool, x: torch.Tensor, f: object, norm: nn.Module) -> torch.Tensor:
    """The one place pre- and post-norm differ."""
    return x + f(norm(x)) if pre_norm else norm(x + f(x))


class EncoderLayer(nn.Module):
    def __init__(self, a: StackArgs) -> None:
        super().__init__()
        self.pre_norm = a.pre_norm
        self.self_attn = EncoderSelfAttention(a)
        self.self_attn_layer_norm = nn.LayerNorm(a.d_model)
        self.fc1 = nn.Linear(a.d_model, a.ffn_dim)
        self.fc2 = nn.Linear(a.ffn_dim, a.d_model)
        self.final_layer_norm = nn.LayerNorm(a.d_model)
        self.act = hf_activation(a.activation)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, d_model]
        x = _sublayer(self.pre_norm, x, self.self_attn, self.self_attn_layer_norm)
        return _sublayer(self.pre_norm, x, self._ffn, self.final_layer_norm)


class DecoderLayer(nn.Module):
    def __init__(self, a: StackArgs, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = a.pre_norm
        self.self_attn = DecoderSelfAttention(a, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(a.d_model)
        self.encoder_attn = DecoderCrossAttention(a)
        self.encoder_attn_layer_norm = nn.LayerNorm(a.d_model)
        self.fc1 = column_linear(a.d_model, a.ffn_dim, bias=True)  # split by rank under tensor parallelism
        self.fc2 = row_linear(a.ffn_dim, a.d_model, bias=True)
        self.final_layer_norm = nn.LayerNorm(a.d_model)
        self.act = hf_activation(a.activation)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, d_model]
        x = _sublayer(self.pre_norm, x, self.self_attn, self.self_attn_layer_norm)
        x = _sublayer(self.pre_norm, x, self.encoder_attn, self.encoder_attn_layer_norm)
        return _sublayer(self.pre_norm, x, self._ffn, self.final_layer_norm)


def store_cross_kv(layers: Iterable[DecoderLayer], row: int, encoder_hidden: torch.Tensor) -> None:
    for layer in layers:
        layer.encoder_attn.store(row, encoder_hidden)


# -- BART -----------------------------------------------------------------------------------

_POSITION_OFFSET = 2  # BART's learned position table starts at row 2 (a fairseq legacy)


class BartEncoder(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        a = stack_args(c, "encoder", pre_norm=False, k_bias=True)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_position_embeddings + _POSITION_OFFSET, c.d_model)
        self.layernorm_embedding = nn.LayerNorm(c.d_model)
        self.layers = nn.ModuleList(EncoderLayer(a) for _ in range(a.num_layers))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, d_model]
        positions = torch.arange(token_ids.shape[0], device=token_ids.device) + _POSITION_OFFSET
        x = self.embed_tokens(token_ids) * self.embed_scale + self.embed_positions(positions)
        x = self.layernorm_embedding(x)
        for layer in self.layers:
            x = layer(x)
        return x


class BartDecoder(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        a = stack_args(c, "decoder", pre_norm=False, k_bias=True)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_position_embeddings + _POSITION_OFFSET, c.d_model)
        self.layernorm_embedding = nn.LayerNorm(c.d_model)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:  # [num_tokens, d_model]
        x = self.embed_tokens(input_ids) * self.embed_scale if inputs_embeds is None else inputs_embeds
        x = self.layernorm_embedding(x + self.embed_positions(positions + _POSITION_OFFSET))
        for layer in self.layers:
            x = layer(x)
        return x


class BartModel(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        self.encoder = BartEncoder(c)
        self.decoder = BartDecoder(c)


def check_decoder_split(c: object, world_size: int) -> None:
    """ValueError when the decoder's heads or feed-forward cannot be split over `world_size`
    ranks (the decoder is split by head; the encoder, embeddings and LM head are replicated)."""
    a = stack_args(c, "decoder", pre_norm=False, k_bias=True)
    even_shard(a.num_heads, 0, world_size, "decoder_attention_heads")
    even_shard(a.ffn_dim, 0, world_size, "decoder_ffn_dim")


class BartForConditionalGeneration(nn.Module):
    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        check_decoder_split(hf_config, world_size)

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.model = BartModel(hf_config)
        self.lm_head = Linear(hf_config.d_model, hf_config.vocab_size, bias=False)
        # A buffer in transformers, but stored in checkpoints: loaded like a weight.
        self.final_logits_bias = nn.Parameter(torch.zeros(1, hf_config.vocab_size))

    def encode(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, d_model]
        return self.model.encoder(token_ids)

    def store_cross_kv(self, row: int, encoder_hidden: torch.Tensor) -> None:
        store_cross_kv(self.model.decoder.layers, row, encoder_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, d_model]
    ) -> torch.Tensor:  # [num_tokens, d_model]
        return self.model.decoder(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, d_model] -> [rows, vocab]
        return vocab_logits(hidden, self.lm_head) + self.final_logits_bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        enc, dec, shared = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "model.shared.weight"
        aliases = {
            enc: (enc, shared, dec),
            dec: (dec, shared, enc),
            "lm_head.weight": ("lm_head.weight", shared, dec),
        }
        loaded = WeightLoader(self).load(resolve_aliases(_default_logits_bias(weights, self.hf_config.vocab_size), aliases))
        share_equal_parameters(self, [(enc, dec, "lm_head.weight")])
        return loaded


def _default_logits_bias(weights: Iterable[tuple[str, torch.Tensor]], vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers treats a missing `final_logits_bias` as zeros; so do we."""
    seen = False
    for name, tensor in weights:
        seen |= name == "final_logits_bias"
        yield name, tensor
    if not seen:
        yield "final_logits_bias", torch.zeros(1, vocab_size)
