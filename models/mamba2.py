"""Mamba2ForCausalLM: a stack of pre-norm Mamba2 mixer blocks (no attention, no MLP).

Checkpoint names follow transformers: `backbone.embeddings`, `backbone.layers.{i}.norm`,
`backbone.layers.{i}.mixer.*`, `backbone.norm_f`, `lm_head` (absent when tied).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from slotrunner.models.causal_lm import MAMBA_NAMES, CausalLM, DecoderStack
from slotrunner.models.layers.mamba.mixer import Mamba2MixerArgs, MambaMixer2, parse_time_step_limit
from slotrunner.models.layers.mamba.parallel import check_mixer_split
from slotrunner.models.layers.norm import RMSNorm


def mixer_args(c: object) -> Mamba2MixerArgs:
    return Mamba2MixerArgs(
        hidden_size=c.hidden_size,
        intermediate_size=int(c.expand * c.hidden_size),
        num_heads=c.num_heads,
        head_dim=c.head_dim,
        state_size=c.state_size,
        n_groups=c.n_groups,
        conv_kernel=c.conv_kernel,
        chunk_size=c.chunk_size,
        use_conv_bias=bool(c.use_conv_bias),
        use_bias=bool(c.use_bias),
        norm_eps=c.layer_norm_epsilon,
        activation=getattr(c, "hidden_act", "silu"),
        time_step_limit=parse_time_step_limit(getattr(c, "time_step_limit", None)),
    )


class Mamba2Block(nn.Module):
    def __init__(self, args: Mamba2MixerArgs, layer_idx: int, residual_in_fp32: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mixer = MambaMixer2(args, layer_idx)
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)))


class Mamba2ForCausalLM(CausalLM):
    """Positions go unused: the state carries the order."""

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the mixers' heads or groups cannot be split over `world_size` ranks."""
        args = mixer_args(hf_config)
        check_mixer_split(args.num_heads, args.n_groups, world_size)

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        args = mixer_args(c)
        residual_in_fp32 = bool(getattr(c, "residual_in_fp32", True))
        layers = (Mamba2Block(args, i, residual_in_fp32) for i in range(c.num_hidden_layers))
        norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon)
        stack = DecoderStack(MAMBA_NAMES, c.vocab_size, c.hidden_size, layers, norm)
        super().__init__(stack, bool(getattr(c, "tie_word_embeddings", False)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    # Original state-spaces checkpoints say `backbone.embedding.` (transformers renames on load).
    for name, tensor in weights:
        yield name.replace("backbone.embedding.", "backbone.embeddings."), tensor
