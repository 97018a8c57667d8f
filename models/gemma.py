"""The Gemma family: Gemma2ForCausalLM and Gemma3ForCausalLM (Gemma 3's text model).

One implementation; the variants differ by flags read from the HF config. Both have (1 + w)
RMSNorms (`unit_offset`), four of them per layer (before and after attention and MLP),
embeddings times sqrt(hidden) rounded to the model's dtype, the attention scale
`query_pre_attn_scalar ** -0.5`, a GeGLU MLP (`hidden_activation`), sliding and full layers by
`layer_types`, and an optional final logit soft cap. Gemma2 soft-caps attention scores
(`attn_logit_softcapping`); Gemma3 instead normalizes q and k per head and gives each layer type
its own RoPE (`rope_parameters` nested by layer type: local layers at `rope_local_base_freq`).
transformers' Gemma3 never applies `attn_logit_softcapping`, so neither does this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.activation import GatedAct
from slotrunner.models.layers.parallel_linear import merged_column_linear, row_linear
from slotrunner.models.layers.lm_head import LogitScale
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.qkv_attention import QKVAttention
from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    hidden_act: str
    attention_bias: bool  # q/k/v/o biases
    scale: float  # query_pre_attn_scalar ** -0.5
    attn_soft_cap: float | None  # Gemma2's attn_logit_softcapping
    final_soft_cap: float | None  # final_logit_softcapping
    qk_norm: bool  # (1 + w) RMSNorm over each head of q and k before RoPE (Gemma3)
    layer_types: tuple[str, ...]  # SLIDING or FULL, per layer
    sliding_window: int | None
    ropes: dict[str, RopeConfig]  # by layer type
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: object, qk_norm: bool, attn_soft_cap: bool) -> GemmaArgs:
        if getattr(c, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (Gemma embedding models) is not supported: only causal decoding")
        layer_types = tuple(getattr(c, "layer_types", None) or ())
        if len(layer_types) != c.num_hidden_layers or not set(layer_types) <= {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must give one of {SLIDING!r} / {FULL!r} per layer ({c.num_hidden_layers}), got {list(layer_types)}"
            )
        num_heads = c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            rms_norm_eps=c.rms_norm_eps,
            max_position=c.max_position_embeddings,
            hidden_act=getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "gelu_pytorch_tanh"),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            scale=float(c.query_pre_attn_scalar) ** -0.5,
            attn_soft_cap=getattr(c, "attn_logit_softcapping", None) if attn_soft_cap else None,
            final_soft_cap=getattr(c, "final_logit_softcapping", None),
            qk_norm=qk_norm,
            layer_types=layer_types,
            sliding_window=getattr(c, "sliding_window", None),
            ropes={t: RopeConfig.from_hf(c, layer_type=t) for t in set(layer_types)},
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        )


class GemmaAttention(QKVAttention):
    def __init__(self, args: GemmaArgs, layer_idx: int) -> None:
        layer_type = args.layer_types[layer_idx]
        spec = AttentionSpec(
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            scale=args.scale,
            sliding_window=args.sliding_window if layer_type == SLIDING else None,
            logits_soft_cap=args.attn_soft_cap,
        )
        rotary = RotaryEmbedding(args.head_dim, args.max_position, args.ropes[layer_type])
        norms = None
        if args.qk_norm:  # Gemma's (1 + w) form
            norms = tuple(RMSNorm(args.head_dim, args.rms_norm_eps, unit_offset=True) for _ in "qk")
        bias = args.attention_bias
        super().__init__(args.hidden_size, spec, layer_idx, rotary, bias, bias, norms)


class GemmaMLP(nn.Module):
    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.gate_up_proj = merged_column_linear(
            args.hidden_size, {"gate": args.intermediate_size, "up": args.intermediate_size}, bias=False
        )
        self.act = GatedAct(args.hidden_act)
        self.down_proj = row_linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(self.gate_up_proj(x), self.act.act)


class GemmaDecoderLayer(nn.Module):
    """transformers' `h + post_norm(attn(pre_norm(h)))`, twice, in the fused-residual form: each
    pre-norm adds the residual in, each post-norm's output is the next sum's other term."""

    def __init__(self, args: GemmaArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(args, layer_idx)
        self.mlp = GemmaMLP(args)
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(CausalLM):
    """Serves Gemma2ForCausalLM; the Gemma3 subclass sets two flags."""

    qk_norm: bool = False
    attn_soft_cap: bool = True  # read `attn_logit_softcapping` (transformers' Gemma3 ignores it)
    merged = QKV_SHARDS | GATE_UP_SHARDS

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the heads or the MLP cannot be split over `world_size` ranks."""
        args = GemmaArgs.from_hf(hf_config, qk_norm=cls.qk_norm, attn_soft_cap=cls.attn_soft_cap)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(args.intermediate_size, 0, world_size, "intermediate_size")

    def __init__(self, hf_config: object) -> None:
        args = GemmaArgs.from_hf(hf_config, qk_norm=self.qk_norm, attn_soft_cap=self.attn_soft_cap)
        layers = (GemmaDecoderLayer(args, i) for i in range(args.num_layers))
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)
        stack = DecoderStack(
            StackNames(), args.vocab_size, args.hidden_size, layers, norm, residual_in_norm=True,
            embedding_multiplier=args.hidden_size**0.5, multiplier_in_dtype=True,
        )
        super().__init__(stack, args.tie_word_embeddings, LogitScale(soft_cap=args.final_soft_cap))
        self.args = args


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attn_soft_cap = False
