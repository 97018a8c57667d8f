"""BambaForCausalLM: Mamba2 mixer layers with attention layers at `attn_layer_indices`.

Every layer is pre-norm: a token mixer (MambaMixer2, or Llama-style GQA attention on the paged
KV cache with partial rotary -- `partial_rotary_factor` 0.5 in Bamba's config), then a SwiGLU
MLP. Checkpoint names follow transformers: `model.layers.{i}.mamba.*` or `.self_attn.*`,
`.feed_forward.*`, `.input_layernorm`, `.pre_ff_layernorm`, `model.final_layernorm`, `lm_head`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from slotrunner.models.layers.mamba.mixer import Mamba2MixerArgs, MambaMixer2
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.llama import LlamaArgs, LlamaAttention, LlamaMLP
from slotrunner.models.weights import WeightLoader


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


class BambaModel(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        args = LlamaArgs.from_hf(c)
        mamba = mixer_args(c)
        attn_layers = set(getattr(c, "attn_layer_indices", None) or ())
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(args, mamba, i, i in attn_layers) for i in range(c.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.final_layernorm(x, residual)
        return x


class BambaForCausalLM(nn.Module):
    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.model = BambaModel(hf_config)
        if bool(getattr(hf_config, "tie_word_embeddings", False)):
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden.to(weight.dtype), weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = WeightLoader(self, merged={
            ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
            ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
            ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
            ".feed_forward.gate_proj.": (".feed_forward.gate_up_proj.", "gate"),
            ".feed_forward.up_proj.": (".feed_forward.gate_up_proj.", "up"),
        })  # fmt: skip
        return loader.load(weights)
