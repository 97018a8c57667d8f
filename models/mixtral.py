"""MixtralForCausalLM: the Llama decoder with a sparse mixture of experts for its MLP.

Attention is Llama's (GQA, RoPE, one `sliding_window` for every layer when set). Each layer's
MLP is a `SparseMoE`: softmax over `num_local_experts` router logits, the top
`num_experts_per_tok` renormalised to sum to 1, SwiGLU experts. Qwen3-MoE (`qwen3_moe.py`)
subclasses this with its flags.

Checkpoint names: `model.layers.{i}.block_sparse_moe.gate.weight` [experts, hidden],
`.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate / up / down), stacked here into
`mlp.experts.w_in` / `w_out`; transformers' in-memory layout (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, already stacked with gate rows first) is accepted too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE, stack_per_expert
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.llama import LlamaArgs, LlamaAttention
from slotrunner.models.weights import QKV_SHARDS


class MoeDecoderLayer(nn.Module):
    """Llama's pre-norm layer (each norm adds the residual in) around any `self_attn` and `mlp`
    modules."""

    def __init__(self, args: LlamaArgs, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: [num_tokens, hidden]
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MixtralForCausalLM(CausalLM):
    qk_norm: ClassVar[bool] = False
    merged = QKV_SHARDS
    # Per-expert checkpoint tensor -> (stacked parameter, part): gate rows before up rows.
    expert_names: ClassVar[dict[str, tuple[str, int]]] = {
        "w1.weight": ("w_in", 0),
        "w3.weight": ("w_in", 1),
        "w2.weight": ("w_out", 0),
    }

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the heads or the experts cannot be split over `world_size` ranks:
        attention splits by head, each rank holds num_experts / world_size whole experts."""
        args = LlamaArgs.from_hf(hf_config, qk_norm=cls.qk_norm)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(hf_config.num_experts, 0, world_size, "num_experts")

    def __init__(self, hf_config: object) -> None:
        args = LlamaArgs.from_hf(hf_config, qk_norm=self.qk_norm)
        layers = (
            MoeDecoderLayer(args, self.build_attention(args, i), self.build_mlp(hf_config, args, i))
            for i in range(args.num_layers)
        )
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        stack = DecoderStack(StackNames(), args.vocab_size, args.hidden_size, layers, norm, residual_in_norm=True)
        super().__init__(stack, args.tie_word_embeddings)
        self.args = args
        self.num_experts = hf_config.num_experts  # Mixtral's config maps it to num_local_experts

    def build_attention(self, args: LlamaArgs, layer_idx: int) -> nn.Module:
        return LlamaAttention(args, layer_idx)

    def build_mlp(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        spec = RouterSpec(c.num_local_experts, c.num_experts_per_tok, "softmax", renormalize=True)
        return SparseMoE(c.hidden_size, c.intermediate_size, spec, ExpertActivation(args.hidden_act))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.")
                name = name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w_in")
                yield name.replace(".mlp.experts.down_proj", ".mlp.experts.w_out"), tensor

        # Stacked before WeightLoader sees the names: its gate/up fusion would claim them.
        return super().load_weights(stack_per_expert(renamed(), ".mlp.experts.", self.expert_names, self.num_experts))
