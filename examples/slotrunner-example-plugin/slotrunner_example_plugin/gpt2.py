"""GPT-2 on slotrunner's shared layers: learned absolute positions, LayerNorm with biases, one
fused q/k/v projection, and checkpoints that store their projections as Conv1D weights."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.models.weights import WeightLoader

# transformers' Conv1D stores its weight as [in_features, out_features]; nn.Linear wants [out, in].
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Older checkpoints (openai-community/gpt2) also store each layer's causal-mask buffers.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class GPT2Args:
    """What the modules need from GPT2Config, read once."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position: int
    intermediate_size: int
    layer_norm_eps: float
    activation: str
    scale_attn_weights: bool  # divide q.k by sqrt(head_dim)
    scale_by_inverse_layer_idx: bool  # ... and by layer_idx + 1
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: object) -> GPT2Args:
        if getattr(c, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported")
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.n_embd,
            num_layers=c.n_layer,
            num_heads=c.n_head,
            max_position=c.n_positions,
            intermediate_size=c.n_inner or 4 * c.n_embd,
            layer_norm_eps=c.layer_norm_epsilon,
            activation=c.activation_function,
            scale_attn_weights=c.scale_attn_weights,
            scale_by_inverse_layer_idx=c.scale_attn_by_inverse_layer_idx,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        )


class GPT2Attention(nn.Module):
    def __init__(self, args: GPT2Args, layer_idx: int) -> None:
        super().__init__()
        head_dim = args.hidden_size // args.num_heads
        self.c_attn = nn.Linear(args.hidden_size, 3 * args.hidden_size)  # [q | k | v]
        self.c_proj = nn.Linear(args.hidden_size, args.hidden_size)
        scale = head_dim**-0.5 if args.scale_attn_weights else 1.0
        if args.scale_by_inverse_layer_idx:
            scale /= layer_idx + 1
        # The paged KV cache, the runner's attention backend and its metadata are all behind this.
        spec = AttentionSpec(num_heads=args.num_heads, num_kv_heads=args.num_heads, head_dim=head_dim, scale=scale)
        self.attn = Attention(spec, layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # each [num_tokens, hidden]
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = hf_activation(args.activation)  # "gelu_new": tanh-approximated GELU
        self.c_proj = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, args: GPT2Args, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attn = GPT2Attention(args, layer_idx)
        self.ln_2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = GPT2MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.hidden_size)
        self.wpe = nn.Embedding(args.max_position, args.hidden_size)  # learned absolute positions
        self.h = nn.ModuleList(GPT2Block(args, i) for i in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        # The runner's positions count from each request's start, chunks and preemption included.
        x = x + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """The runner calls forward(input_ids, positions, inputs_embeds=..., **ModelInputs),
    compute_logits(hidden) and load_weights(weights); the rest is an ordinary nn.Module."""

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.args = GPT2Args.from_hf(hf_config)
        self.transformer = GPT2Model(self.args)  # named like the checkpoint's tensors
        # None: tied to the token embedding; the loader then skips lm_head.weight if present.
        self.lm_head = None if self.args.tie_word_embeddings else nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.transformer(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = WeightLoader(self, ignore_unexpected=MASK_BUFFERS)
        return loader.load(checkpoint_to_model(weights))


def checkpoint_to_model(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names and layouts -> this module tree's: Conv1D weights transposed, and the
    `transformer.` prefix added where a checkpoint of the bare GPT2Model left it out."""
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        yield name, tensor
