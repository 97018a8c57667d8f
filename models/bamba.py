"""BambaForCausalLM: Mamba2 mixer layers with attention layers at `attn_layer_indices`.

Every layer is pre-norm: a token mixer (MambaMixer2, or Llama-style GQA attention on the paged
KV cache with partial rotary -- `partial_rotary_factor` 0.5 in Bamba's config), then a SwiGLU
MLP. Checkpoint names follow transformers: `model.layers.{i}.mamba.*` or `.self_attn.*`,
`.feed_forward.*`, `.input_layernorm`, `.pre_ff_layernorm`, `model.final_layernorm`, `lm_head`.
"""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.mamba.mixer import Mamba2MixerArgs, MambaMixer2
from slotrunner.models.layers.mamba.parallel import check_mixer_split
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.llama import LlamaArgs, LlamaAttention, LlamaMLP
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS


def mixer_args(c: object) -> Mamba2MixerArgs:
    return Mamba2MixerArgs.from_mamba_prefixed(c)


class BambaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, mamba: Mamba2MixerArgs, layer_idx: int, is_attention: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = LlamaAttention(args, layer_idx)
        else:
            self.mamba = MambaMixer2(mamba, layer_idx)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = LlamaMLP(args)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x) if self.is_attention else self.mamba(x)
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class BambaForCausalLM(CausalLM):
    merged = QKV_SHARDS | GATE_UP_SHARDS

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the attention heads, the MLP or the mixers' heads or groups cannot be
        split over `world_size` ranks."""
        args, mamba = LlamaArgs.from_hf(hf_config), mixer_args(hf_config)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(args.intermediate_size, 0, world_size, "intermediate_size")
        check_mixer_split(mamba.num_heads, mamba.n_groups, world_size)

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        args, mamba = LlamaArgs.from_hf(c), mixer_args(c)
        attn_layers = set(getattr(c, "attn_layer_indices", None) or ())
        layers = (BambaDecoderLayer(args, mamba, i, i in attn_layers) for i in range(c.num_hidden_layers))
        norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        names = StackNames(final_norm="final_layernorm")
        stack = DecoderStack(names, c.vocab_size, c.hidden_size, layers, norm, residual_in_norm=True)
        super().__init__(stack, args.tie_word_embeddings)
