"""NemotronHForCausalLM: one mixer per layer -- Mamba2, attention, relu2 MLP or MoE -- named by
`layers_block_type` ("linear_attention", "full_attention", "mlp", "moe"; older configs spell
the pattern "M", "*", "-", "E", which transformers converts).

Each block is pre-norm with a plain residual: h + mixer(norm(h)). Attention is GQA without any
position embedding (NemotronH has no rotary). The MoE routes with sigmoid scores plus
`e_score_correction_bias` (DeepSeek-V3 style, optionally grouped), renormalises, scales by
`routed_scaling_factor`, and adds a shared relu2 expert; experts are non-gated relu2 MLPs.
transformers clamps dt to (time_step_min, inf) in the Mamba mixer, and so does this model.

Checkpoint names: `backbone.embeddings`, `backbone.layers.{i}.norm`, `.mixer.*` (Mamba2 names;
`q_proj/k_proj/v_proj/o_proj`; `up_proj/down_proj`; `gate.weight`, `gate.e_score_correction_bias`,
`experts.{e}.up_proj/down_proj`, `shared_experts.*`), `backbone.norm_f`, `lm_head`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from slotrunner.models.causal_lm import MAMBA_NAMES, CausalLM, DecoderStack
from slotrunner.models.granite_moe_hybrid import GraniteAttention
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.layers.mamba.parallel import check_mixer_split
from slotrunner.models.layers.parallel_linear import merged_column_linear, row_linear
from slotrunner.models.layers.mamba.mixer import Mamba2MixerArgs, MambaMixer2
from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE, stack_per_expert
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.rotary import RopeConfig
from slotrunner.models.llama import LlamaArgs
from slotrunner.models.weights import QKV_SHARDS

_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def mixer_args(c: object) -> Mamba2MixerArgs:
    return Mamba2MixerArgs(
        hidden_size=c.hidden_size,
        intermediate_size=c.mamba_num_heads * c.mamba_head_dim,
        num_heads=c.mamba_num_heads,
        head_dim=c.mamba_head_dim,
        state_size=c.ssm_state_size,
        n_groups=c.n_groups,
        conv_kernel=c.conv_kernel,
        chunk_size=c.chunk_size,
        use_conv_bias=bool(c.use_conv_bias),
        use_bias=bool(c.use_bias),
        norm_eps=c.layer_norm_epsilon,
        activation=c.mamba_hidden_act,
        time_step_limit=(float(c.time_step_min), math.inf),
    )


def attention_args(c: object) -> LlamaArgs:
    num_layers = len(c.layers_block_type)
    return LlamaArgs(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=num_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.layer_norm_epsilon,
        max_position=c.max_position_embeddings,
        rope=RopeConfig(theta=10000.0),  # built by LlamaAttention, never applied
        hidden_act="silu",
        attention_bias=bool(c.attention_bias),
        o_bias=bool(c.attention_bias),
        mlp_bias=False,
        qk_norm=False,
        sliding_windows=(None,) * num_layers,  # transformers' NemotronH ignores `sliding_window`
        tie_word_embeddings=bool(c.tie_word_embeddings),
    )


class NemotronHMLP(nn.Module):
    def __init__(self, c: object, intermediate_size: int) -> None:
        super().__init__()
        # Column- then row-parallel under tensor parallelism (one part: a merged layer of one).
        self.up_proj = merged_column_linear(c.hidden_size, {"up": intermediate_size}, bias=bool(c.mlp_bias))
        self.down_proj = row_linear(intermediate_size, c.hidden_size, bias=bool(c.mlp_bias))
        self.act = hf_activation(c.mlp_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def nemotron_h_moe(c: object) -> SparseMoE:
    """Sigmoid routing on float32 logits, chosen with `e_score_correction_bias` (grouped when
    `n_group` > 1), non-gated relu2 experts, one shared relu2 expert."""
    if getattr(c, "moe_latent_size", None) is not None:
        raise ValueError("NemotronH: moe_latent_size (latent MoE projections) is not supported")
    spec = RouterSpec(
        c.n_routed_experts, c.num_experts_per_tok, "sigmoid", bool(c.norm_topk_prob), c.n_group, c.topk_group,
        float(c.routed_scaling_factor),
    )  # fmt: skip
    act = ExpertActivation(c.mlp_hidden_act, gated=False)
    shared = NemotronHMLP(c, c.moe_shared_expert_intermediate_size)
    return SparseMoE(
        c.hidden_size, c.moe_intermediate_size, spec, act, shared, correction_bias=True, fp32_logits=True
    )


class NemotronHBlock(nn.Module):
    def __init__(self, c: object, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon)
        self.kind = _KINDS[c.layers_block_type[layer_idx]]
        if self.kind == "mamba":
            self.mixer = MambaMixer2(mixer_args(c), layer_idx)
        elif self.kind == "attention":
            self.mixer = GraniteAttention(args, layer_idx, args.head_dim**-0.5, use_rope=False)
        elif self.kind == "mlp":
            self.mixer = NemotronHMLP(c, c.intermediate_size)
        else:
            self.mixer = nemotron_h_moe(c)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        x = self.mixer(positions, x) if self.kind == "attention" else self.mixer(x)
        return h + x


class NemotronHForCausalLM(CausalLM):
    merged = QKV_SHARDS  # not gate/up: the MLPs' `up_proj` loads whole, under its own name

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the attention heads, the MLPs, the experts or the mixers' heads
        cannot be split over `world_size` ranks."""
        c, args = hf_config, attention_args(hf_config)
        kinds = {_KINDS.get(k) for k in c.layers_block_type}
        if "attention" in kinds:
            check_head_split(args.num_heads, args.num_kv_heads, world_size)
        if "mlp" in kinds:
            even_shard(c.intermediate_size, 0, world_size, "intermediate_size")
        if "moe" in kinds:
            even_shard(c.n_routed_experts, 0, world_size, "n_routed_experts")
            even_shard(c.moe_shared_expert_intermediate_size, 0, world_size, "moe_shared_expert_intermediate_size")
        if "mamba" in kinds:
            mamba = mixer_args(c)
            check_mixer_split(mamba.num_heads, mamba.n_groups, world_size)

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        unknown = set(c.layers_block_type) - set(_KINDS)
        if unknown:
            raise ValueError(
                f"NemotronH: block types {sorted(unknown)} are not supported (supported: {sorted(_KINDS)})"
            )
        args = attention_args(c)
        layers = (NemotronHBlock(c, args, i) for i in range(len(c.layers_block_type)))
        norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon)
        super().__init__(DecoderStack(MAMBA_NAMES, c.vocab_size, c.hidden_size, layers, norm), args.tie_word_embeddings)
        self.num_experts = getattr(c, "n_routed_experts", 0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            # Experts stored stacked (3-D) rather than one by one: the same tensors, other names.
            for name, tensor in weights:
                name = name.replace(".mixer.experts.up_proj", ".mixer.experts.w_in")
                yield name.replace(".mixer.experts.down_proj", ".mixer.experts.w_out"), tensor

        per_expert = {"up_proj.weight": ("w_in", 0), "down_proj.weight": ("w_out", 0)}
        return super().load_weights(stack_per_expert(renamed(), ".mixer.experts.", per_expert, self.num_experts))
