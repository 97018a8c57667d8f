"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

One implementation; the variants differ only by flags read from the HF config (qkv bias for
Qwen2, q/k RMSNorm for Qwen3, sliding windows for Mistral and `layer_types`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.layers.activation import GatedAct
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.linear import Linear, MergedLinear
from slotrunner.models.layers.mrope import MRotaryEmbedding
from slotrunner.models.layers.native_decode import NativeLayerParts
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.parallel_linear import merged_column_linear, row_linear
from slotrunner.models.layers.qkv_attention import QKVAttention
from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    hidden_act: str
    attention_bias: bool  # q/k/v biases (Qwen2; Llama's `attention_bias`)
    o_bias: bool  # o_proj bias (Llama's `attention_bias` covers it too, Qwen2's does not)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer
    tie_word_embeddings: bool
    # M-RoPE channel groups (Qwen2-VL's language model): positions may then be [3, num_tokens].
    mrope_section: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, c: object, qkv_bias: bool | None = None, qk_norm: bool = False) -> LlamaArgs:
        num_heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        layer_types = getattr(c, "layer_types", None)
        window = getattr(c, "sliding_window", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        elif getattr(c, "use_sliding_window", True) is False:
            windows = (None,) * c.num_hidden_layers
        else:
            windows = (window,) * c.num_hidden_layers
        attention_bias = bool(getattr(c, "attention_bias", False))
        rope_params = {**(getattr(c, "rope_scaling", None) or {}), **(getattr(c, "rope_parameters", None) or {})}
        mrope_section = rope_params.get("mrope_section")
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            max_position=c.max_position_embeddings,
            rope=RopeConfig.from_hf(c),
            hidden_act=getattr(c, "hidden_act", "silu"),
            attention_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias and qkv_bias is None,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_windows=windows,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            mrope_section=tuple(mrope_section) if mrope_section else None,
        )


class LlamaAttention(QKVAttention):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        if args.mrope_section is None:
            rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope)
        else:
            rotary = MRotaryEmbedding(args.head_dim, args.max_position, args.rope, args.mrope_section)
        spec = AttentionSpec(
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            scale=args.head_dim**-0.5,
            sliding_window=args.sliding_windows[layer_idx],
        )
        norms = None
        if args.qk_norm:
            norms = (RMSNorm(args.head_dim, args.rms_norm_eps), RMSNorm(args.head_dim, args.rms_norm_eps))
        super().__init__(args.hidden_size, spec, layer_idx, rotary, args.attention_bias, args.o_bias, norms)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = merged_column_linear(
            args.hidden_size, {"gate": args.intermediate_size, "up": args.intermediate_size}, bias=args.mlp_bias
        )
        self.act = GatedAct(args.hidden_act)
        self.down_proj = row_linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(self.gate_up_proj(x), self.act.act)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), x + residual) with h, x + residual = norm(x, residual): the residual add and
        norm in the gate/up projection's launch where it can (`Linear.forward_normed`); a
        subclass with its own forward gets the norm first."""
        if type(self).forward is not LlamaMLP.forward:
            x, residual = norm(x, residual)
            return self(x), residual
        h, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj.forward_gated(h, self.act.act), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_idx)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm runs in the launch of the product after it where the skinny GEMM can (Linear).
        if residual is None:
            residual, x = x, self.input_layernorm(x)
            x = self.self_attn(positions, x)
        else:
            x, residual = self.self_attn.forward_normed(positions, x, residual, self.input_layernorm)
        if not isinstance(self.mlp, LlamaMLP):  # a subclass's own MLP module
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        return self.mlp.forward_normed(x, residual, self.post_attention_layernorm)

    def native_parts(self) -> NativeLayerParts | None:
        """The layer's parts for the CPU's one-call decode (models/layers/native_decode.py), or
        None where it is not exactly this class's form: M-RoPE, tensor-parallel linears, or a
        subclass's own forward."""
        attn, mlp = self.self_attn, self.mlp
        if (
            type(self).forward is not LlamaDecoderLayer.forward or type(attn).forward is not QKVAttention.forward
            or type(mlp).forward is not LlamaMLP.forward or type(attn.rotary_emb) is not RotaryEmbedding
            or type(attn.qkv_proj) is not MergedLinear or type(attn.o_proj) is not Linear
            or type(mlp.gate_up_proj) is not MergedLinear or type(mlp.down_proj) is not Linear
            or type(self.input_layernorm).forward is not RMSNorm.forward
            or type(self.post_attention_layernorm).forward is not RMSNorm.forward
            or (attn.qk_norm and not (type(attn.q_norm) is type(attn.k_norm) is RMSNorm))
        ):  # fmt: skip
            return None
        return NativeLayerParts(
            self.input_layernorm, attn.qkv_proj, attn.rotary_emb.cos_sin, attn.attn, attn.o_proj,
            self.post_attention_layernorm, mlp.gate_up_proj, mlp.act.act, mlp.down_proj,
            attn.q_norm if attn.qk_norm else None, attn.k_norm if attn.qk_norm else None,
        )  # fmt: skip


class LlamaForCausalLM(CausalLM):
    """Serves LlamaForCausalLM and MistralForCausalLM; Qwen2/Qwen3 subclasses set two flags."""

    qkv_bias: bool | None = None  # None: follow the config's `attention_bias`
    qk_norm: bool = False
    merged = QKV_SHARDS | GATE_UP_SHARDS

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the heads or the MLP cannot be split over `world_size` ranks (called
        before any rank is started; the layers split by query head, KV head, MLP row)."""
        args = LlamaArgs.from_hf(hf_config, qkv_bias=cls.qkv_bias, qk_norm=cls.qk_norm)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(args.intermediate_size, 0, world_size, "intermediate_size")

    def __init__(self, hf_config: object) -> None:
        args = LlamaArgs.from_hf(hf_config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        layers = (LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        stack = DecoderStack(StackNames(), args.vocab_size, args.hidden_size, layers, norm, residual_in_norm=True)
        super().__init__(stack, args.tie_word_embeddings)
        self.args = args


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
