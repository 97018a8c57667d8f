"""CausalLM: the shell every decoder-only architecture shares, around its `DecoderStack`.

A decoder-only checkpoint is a stack -- token embedding, layers, final norm -- under one prefix,
and an output head `lm_head`, absent when `tie_word_embeddings` (the embedding's table serves).
An architecture builds its layers and states what differs as data: the checkpoint's names
(`StackNames`), how its layers carry the residual, its embedding and logit scalars, and which
checkpoint tensors fuse into one weight (`merged`). The embedding is a `VocabEmbedding` and the
head a `Linear`, so every family loads dense and packed (GGUF) weights the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from slotrunner.models.layers.linear import VocabEmbedding
from slotrunner.models.layers.lm_head import LogitScale, vocab_logits
from slotrunner.models.layers.native_decode import NativeDecodeStack
from slotrunner.models.layers.parallel_linear import output_head, vocab_embedding
from slotrunner.models.weights import WeightLoader


@dataclass(frozen=True)
class StackNames:
    """The checkpoint's names: `{stack}.{embedding}.weight`, `{stack}.layers.{i}.*`,
    `{stack}.{final_norm}.weight`."""

    stack: str = "model"
    embedding: str = "embed_tokens"
    final_norm: str = "norm"


MAMBA_NAMES = StackNames(stack="backbone", embedding="embeddings", final_norm="norm_f")  # Mamba2, NemotronH


class DecoderStack(nn.Module):
    """Token embedding -> layers -> final norm, under the checkpoint's names.

    With `residual_in_norm` each layer is called `layer(positions, x, residual) -> (x, residual)`
    and its norms add the residual in (Llama's fused form; the final norm adds the last one);
    otherwise `layer(positions, h) -> h`, each layer adding its own residual.
    """

    def __init__(
        self,
        names: StackNames,
        vocab_size: int,
        hidden_size: int,
        layers: Iterable[nn.Module],
        final_norm: nn.Module,
        residual_in_norm: bool = False,
        embedding_multiplier: float = 1.0,  # times the looked-up embeddings (Granite, FalconH1)
        multiply_inputs_embeds: bool = False,  # ... and times given `inputs_embeds` (Granite)
        # Round the multiplier to the embeddings' dtype first (Gemma: sqrt(hidden) as a tensor of
        # the model's dtype, 55.4256 -> 55.5 in bf16).
        multiplier_in_dtype: bool = False,
    ) -> None:
        super().__init__()
        self.names = names
        self.add_module(names.embedding, vocab_embedding(vocab_size, hidden_size))  # split by rank under TP
        self.layers = nn.ModuleList(layers)
        self.add_module(names.final_norm, final_norm)
        self.residual_in_norm = residual_in_norm
        self.embedding_multiplier = embedding_multiplier
        self.multiply_inputs_embeds = multiply_inputs_embeds
        self.multiplier_in_dtype = multiplier_in_dtype
        # On a CPU, decode steps of layers in Llama's form run one native call a layer
        # (models/layers/native_decode.py): the same kernels, the same bits, less Python.
        self.native_decode = NativeDecodeStack(list(self.layers)) if residual_in_norm else None

    @property
    def token_embedding(self) -> VocabEmbedding:
        return getattr(self, self.names.embedding)

    @property
    def output_norm(self) -> nn.Module:
        return getattr(self, self.names.final_norm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:  # shapes as CausalLM.forward's
        x = self.token_embedding(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embedding_multiplier != 1.0 and (inputs_embeds is None or self.multiply_inputs_embeds):
            multiplier = self.embedding_multiplier
            if self.multiplier_in_dtype:  # a host-side rounding: no device work, graph-safe
                multiplier = float(torch.tensor(multiplier, dtype=x.dtype))
            x = x * multiplier
        if not self.residual_in_norm:
            for layer in self.layers:
                x = layer(positions, x)
            return self.output_norm(x)
        native = self.native_decode.run(positions, x) if x.device.type == "cpu" and self.native_decode else None
        if native is not None:
            x, residual = native
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        x, _ = self.output_norm(x, residual)
        return x


class CausalLM(nn.Module):
    """forward -> the stack, compute_logits -> the LM head, load_weights -> WeightLoader.

    A subclass builds its `DecoderStack` and calls `super().__init__(stack, tie_word_embeddings,
    logit_scale)`; it sets `merged` to the fusions its modules use (weights.py's QKV_SHARDS,
    GATE_UP_SHARDS) and overrides `load_weights` only to rename or restack checkpoint tensors
    on their way here.
    """

    merged: ClassVar[dict[str, tuple[str, str]]] = {}  # WeightLoader's `merged`

    def __init__(self, stack: DecoderStack, tie_word_embeddings: bool, logit_scale: LogitScale = LogitScale()) -> None:
        super().__init__()
        self.add_module(stack.names.stack, stack)
        self.stack_name = stack.names.stack
        embedding = stack.token_embedding
        # None when tied: the embedding's table serves, and the loader skips a stored lm_head.weight.
        self.lm_head = None if tie_word_embeddings else output_head(embedding)
        self.logit_scale = logit_scale

    @property
    def stack(self) -> DecoderStack:
        return getattr(self, self.stack_name)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] (or [3, num_tokens] with M-RoPE)
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.stack(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        table = self.stack.token_embedding if self.lm_head is None else self.lm_head
        return vocab_logits(hidden, table, self.logit_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return WeightLoader(self, merged=self.merged).load(weights)
