"""GraniteMoeHybridForCausalLM (Granite 4.0): Mamba2 mixer and attention layers, each followed by
a top-k MoE plus a shared SwiGLU MLP.

Granite's scalars: embeddings times `embedding_multiplier`, every sublayer output times
`residual_multiplier` before it joins the residual, attention scaled by `attention_multiplier`
(not head_dim**-0.5), logits divided by `logits_scaling`. Rotary only when
`position_embedding_type == "rope"` (Granite 4.0 itself uses none). `layer_types` ("linear_attention"
/ "full_attention") picks each layer's mixer. Checkpoint names: `model.layers.{i}.mamba.*` or
`.self_attn.*`, `.block_sparse_moe.input_linear.weight` [experts, 2 * inter, hidden] (gate rows
first), `.block_sparse_moe.output_linear.weight`, `.block_sparse_moe.router.layer.weight`,
`.shared_mlp.input_linear` / `.output_linear`, `model.norm`, `lm_head`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from slotrunner.models.bamba import mixer_args
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.activation import GatedAct
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.layers.mamba.parallel import check_mixer_split
from slotrunner.models.layers.parallel_linear import merged_column_linear, row_linear
from slotrunner.models.layers.lm_head import LogitScale
from slotrunner.models.layers.mamba.mixer import MambaMixer2
from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.llama import LlamaArgs, LlamaAttention
from slotrunner.models.weights import QKV_SHARDS


class GraniteAttention(LlamaAttention):
    """Llama GQA on the paged cache, scaled by `attention_multiplier`, rotary optional."""

    def __init__(self, args: LlamaArgs, layer_idx: int, scale: float, use_rope: bool) -> None:
        super().__init__(args, layer_idx)
        self.attn = Attention(replace(self.attn.spec, scale=scale), layer_idx)
        self.use_rope = use_rope

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, rotate=self.rotation(positions) if self.use_rope else None))


class SharedMLP(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        # The checkpoint's one [gate | up] tensor, split per part under tensor parallelism.
        size = c.shared_intermediate_size
        self.input_linear = merged_column_linear(c.hidden_size, {"gate": size, "up": size}, bias=False)
        self.act = GatedAct(c.hidden_act)
        self.output_linear = row_linear(size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear(x)))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, c: object, args: LlamaArgs, layer_idx: int, is_attention: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.is_attention = is_attention
        if is_attention:
            use_rope = getattr(c, "position_embedding_type", None) == "rope"
            self.self_attn = GraniteAttention(args, layer_idx, float(c.attention_multiplier), use_rope)
        else:
            self.mamba = MambaMixer2(mixer_args(c), layer_idx)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.block_sparse_moe = None
        if (c.num_local_experts or 0) > 0:  # softmax over the top-k logits = softmax, top-k, renormalise
            spec = RouterSpec(c.num_local_experts, c.num_experts_per_tok, "softmax", renormalize=True)
            self.block_sparse_moe = SparseMoE(c.hidden_size, c.intermediate_size, spec, ExpertActivation(c.hidden_act))
        self.shared_mlp = SharedMLP(c)
        self.residual_multiplier = float(c.residual_multiplier)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.self_attn(positions, x) if self.is_attention else self.mamba(x)
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return h + out * self.residual_multiplier


class GraniteMoeHybridForCausalLM(CausalLM):
    merged = QKV_SHARDS

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the attention heads, the shared MLP, the experts or the mixers'
        heads cannot be split over `world_size` ranks."""
        c, args = hf_config, LlamaArgs.from_hf(hf_config)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(c.shared_intermediate_size, 0, world_size, "shared_intermediate_size")
        if (c.num_local_experts or 0) > 0:
            even_shard(c.num_local_experts, 0, world_size, "num_local_experts")
        mamba = mixer_args(c)
        check_mixer_split(mamba.num_heads, mamba.n_groups, world_size)

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        args = LlamaArgs.from_hf(c)
        kinds = list(c.layer_types)
        unknown = set(kinds) - {"linear_attention", "full_attention", "mamba", "attention"}
        if unknown:
            raise ValueError(f"GraniteMoeHybrid: layer types {sorted(unknown)} are not supported")
        layers = (
            GraniteMoeHybridDecoderLayer(c, args, i, kinds[i] in ("full_attention", "attention"))
            for i in range(c.num_hidden_layers)
        )
        norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        stack = DecoderStack(
            StackNames(), c.vocab_size, c.hidden_size, layers, norm,
            embedding_multiplier=float(c.embedding_multiplier), multiply_inputs_embeds=True,
        )  # fmt: skip
        super().__init__(stack, args.tie_word_embeddings, LogitScale(divisor=float(c.logits_scaling)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renames = {
            ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.w_in",
            ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.w_out",
            ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.gate.weight",
        }

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in renames.items():
                    if name.endswith(old):
                        name = name[: -len(old)] + new
                yield name, tensor

        return super().load_weights(renamed())
