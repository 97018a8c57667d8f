"""Qwen3-Next and Qwen3.5 (text): gated delta-net layers, gated full attention, MoE or dense MLPs.

`layer_types` says per layer whether its token mixer is a `GatedDeltaNet` ("linear_attention",
recurrent state per slot) or gated full attention ("full_attention", paged KV): q_proj yields,
per head, the query and an output gate; q and k get a per-head RMSNorm; RoPE rotates the first
`partial_rotary_factor` of each head; the attention output is times sigmoid(gate) before o_proj.
Every norm of the decoder scales by (1 + w) (zero-centred weights); the delta-net's output norm
by w. MLPs: a sparse MoE (softmax router, top `num_experts_per_tok`, renormalised when
`norm_topk_prob` -- always for Qwen3.5-MoE) plus a shared expert scaled by
sigmoid(shared_expert_gate(x)) where layer i is sparse (`num_experts` > 0, i not in
`mlp_only_layers`, (i + 1) a multiple of `decoder_sparse_step`), else a dense SwiGLU MLP.

Qwen3.5 differs in its delta-net projections (four, not two fused: see the layer) and, for the
dense model, has no experts. Its M-RoPE sections matter only for images: with text the three
position axes are equal and M-RoPE is plain RoPE.

Checkpoint names follow transformers: `model.layers.{i}.linear_attn.*` or `.self_attn.*`,
`.mlp.gate.weight`, `.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight` (or the stacked
`gate_up_proj` / `down_proj`), `.mlp.shared_expert.*`, `.mlp.shared_expert_gate.weight`;
multi-token-prediction heads (`mtp.*`) are not used and skipped.

Tensor parallelism: the delta-nets split by key head (gated_delta_net/parallel.py), the gated
attention by query and KV head (a head's gate rows with it), MLPs and shared experts by row, the
routed experts whole over the ranks; the routers and `shared_expert_gate` stay whole on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.fused_moe import ExpertActivation
from slotrunner.models.layers.gated_delta_net.layer import GatedDeltaNet, GatedDeltaNetArgs
from slotrunner.models.layers.gated_delta_net.parallel import check_delta_net_split
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.moe import RouterSpec, TopKRouter, fused_experts, stack_per_expert
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.parallel_linear import qkv_linear, rank_spec, row_linear
from slotrunner.models.layers.rotary import RotaryEmbedding
from slotrunner.models.llama import LlamaArgs, LlamaMLP
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields a per-head output gate (Qwen3-Next)."""

    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.attention_bias
        spec = AttentionSpec(args.num_heads, args.num_kv_heads, args.head_dim, scale=args.head_dim**-0.5)
        # q_proj rows: per head, head_dim query rows then head_dim gate rows.
        self.qkv_proj = qkv_linear(args.hidden_size, spec, bias, q_rows_per_head=2)
        self.o_proj = row_linear(args.num_heads * args.head_dim, args.hidden_size, bias=bias)
        spec = rank_spec(spec)  # under tensor parallelism: this rank's heads, and KV cache for them
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, unit_offset=True)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.max_position, args.rope)
        self.attn = Attention(spec, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(n, -1, 2 * self.head_dim).chunk(2, dim=-1)  # each [num_tokens, num_heads, head_dim]

        def rotate(q: torch.Tensor, k: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:  # backend.Rotate
            return self.rotary_emb.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm, kv)

        out = self.attn(q.contiguous(), k, v, rotate=rotate)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class SharedExpertMoE(nn.Module):
    """Routed experts plus one shared expert every token passes through, scaled per token by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, args: LlamaArgs, spec: RouterSpec, moe_intermediate: int, shared_intermediate: int) -> None:
        super().__init__()
        self.gate = TopKRouter(args.hidden_size, spec)
        self.experts = fused_experts(spec.num_experts, args.hidden_size, moe_intermediate, ExpertActivation(args.hidden_act))
        self.shared_expert = LlamaMLP(dataclasses.replace(args, intermediate_size=shared_intermediate, mlp_bias=False))
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)  # whole on every rank, as the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        topk_weights, topk_ids = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, topk_weights, topk_ids, add=shared)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, mixer: nn.Module, is_linear: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = is_linear
        if is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: [num_tokens, hidden]
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x) if self.is_linear else self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(CausalLM):
    """Serves Qwen3NextForCausalLM; the Qwen3.5 classes below set `fused_projections` off."""

    fused_projections: ClassVar[bool] = True
    merged = QKV_SHARDS | GATE_UP_SHARDS
    expert_names: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj.weight": ("w_in", 0),
        "up_proj.weight": ("w_in", 1),
        "down_proj.weight": ("w_out", 0),
    }

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the attention heads, the delta-nets' key or value heads, the MLPs or
        the experts cannot be split over `world_size` ranks (attention and delta-nets split by
        head, MLPs and shared experts by row, each rank holds num_experts / world_size experts)."""
        c = hf_config
        args = LlamaArgs.from_hf(_WithDefaults(c, intermediate_size=0))
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        check_delta_net_split(c.linear_num_key_heads, c.linear_num_value_heads, world_size)
        even_shard(args.intermediate_size, 0, world_size, "intermediate_size")
        if getattr(c, "num_experts", 0):
            even_shard(c.num_experts, 0, world_size, "num_experts")
            even_shard(c.shared_expert_intermediate_size, 0, world_size, "shared_expert_intermediate_size")

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        # Qwen3.5-MoE's config has no intermediate_size (every layer is sparse): no dense MLP is built.
        args = LlamaArgs.from_hf(_WithDefaults(c, intermediate_size=0))
        gdn = GatedDeltaNetArgs.from_hf(c, self.fused_projections)
        layer_types = list(c.layer_types)
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown or len(layer_types) != c.num_hidden_layers:
            raise ValueError(
                f"{type(self).__name__}: layer_types must give one of {LAYER_TYPES} for each of the "
                f"{c.num_hidden_layers} layers, got {layer_types}"
            )
        self.num_experts = getattr(c, "num_experts", 0) or 0
        layers = []
        for i, kind in enumerate(layer_types):
            is_linear = kind == "linear_attention"
            mixer = GatedDeltaNet(gdn, i) if is_linear else GatedAttention(args, i)
            layers.append(Qwen3NextDecoderLayer(args, mixer, is_linear, self._mlp(c, args, i)))
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)
        stack = DecoderStack(StackNames(), args.vocab_size, args.hidden_size, layers, norm, residual_in_norm=True)
        super().__init__(stack, args.tie_word_embeddings)
        self.args = args

    def _mlp(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        sparse = (
            self.num_experts > 0
            and layer_idx not in (getattr(c, "mlp_only_layers", None) or ())
            and (layer_idx + 1) % (getattr(c, "decoder_sparse_step", 1) or 1) == 0
        )
        if not sparse:
            return LlamaMLP(args)
        renormalize = bool(getattr(c, "norm_topk_prob", True))  # Qwen3.5-MoE has no flag: always
        spec = RouterSpec(self.num_experts, c.num_experts_per_tok, "softmax", renormalize=renormalize)
        return SharedExpertMoE(args, spec, c.moe_intermediate_size, c.shared_expert_intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("mtp.", "model.visual.")):  # MTP draft heads, a VLM's tower: unused
                    continue
                name = name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w_in")
                yield name.replace(".mlp.experts.down_proj", ".mlp.experts.w_out"), tensor

        # Stacked before WeightLoader sees the names: its gate/up fusion would claim them.
        return super().load_weights(stack_per_expert(renamed(), ".mlp.experts.", self.expert_names, max(self.num_experts, 1)))


class _WithDefaults:
    """The HF config, with values for fields it lacks (read only by LlamaArgs.from_hf)."""

    def __init__(self, config: object, **defaults: object) -> None:
        self._config, self._defaults = config, defaults

    def __getattr__(self, name: str) -> object:
        try:
            return getattr(self._config, name)
        except AttributeError:
            if name in self._defaults:
                return self._defaults[name]
            raise


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    fused_projections = False


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    fused_projections = False
