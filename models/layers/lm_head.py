"""The LM head: logits from the final hidden states, the one place any model computes them.

The vocabulary table is a [vocab, hidden] weight -- the model's own output matrix (`lm_head`, a
`Linear`), or the token embedding (`VocabEmbedding`) when the head is tied to it -- held dense,
or packed in GGUF blocks on a CPU (the native kernel then multiplies it). A family's logit
scalars (`LogitScale`) follow, applied as transformers applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slotrunner.core_runner.cpu.packed import packed_linear
from slotrunner.models.layers.linear import Linear, VocabEmbedding
from slotrunner.models.layers.parallel_linear import VocabParallel
from slotrunner.models.layers.skinny_gemm import skinny_linear, wants_skinny


@dataclass(frozen=True)
class LogitScale:
    """Logits times `multiplier` (FalconH1's `lm_head_multiplier`), then divided by `divisor`
    (Granite's `logits_scaling`), then soft-capped by `soft_cap`. Two fields rather than one
    factor: a division by 1.5 and a product with 1 / 1.5 round differently, and each family
    rounds as its transformers model."""

    multiplier: float = 1.0
    divisor: float = 1.0
    soft_cap: float | None = None  # then cap * tanh(logits / cap) (Gemma2/3's `final_logit_softcapping`)

    def __post_init__(self) -> None:
        if self.divisor == 0:
            raise ValueError("logit divisor (logits_scaling) must not be 0")
        if self.soft_cap is not None and self.soft_cap <= 0:
            raise ValueError(f"final logit soft cap must be > 0 or None, got {self.soft_cap}")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits


def vocab_logits(
    hidden: torch.Tensor,  # [rows, hidden]
    table: Linear | VocabEmbedding,  # [vocab, hidden]: the output matrix, or the tied embedding
    scale: LogitScale = LogitScale(),
) -> torch.Tensor:  # [rows, vocab]
    """hidden @ table.T, scaled. Hidden states in another dtype than a dense table (Mamba2 keeps
    its residual stream in float32) are cast to the table's, as transformers' head does."""
    if table.packed is not None:
        logits = packed_linear(hidden, table.packed)
    else:
        hidden = hidden.to(table.weight.dtype)
        # One row (a batch-1 decode): the skinny kernel reads the table at 4.3 TB/s against
        # cuBLAS's 4.1 on one H200 (Qwen3's 151936 x 1024: 71 against 75 us); from two rows on it loses.
        one_row = wants_skinny(hidden, table.weight, max_rows=1)
        logits = skinny_linear(hidden, table.weight) if one_row else F.linear(hidden, table.weight)
    if isinstance(table, VocabParallel):  # each rank holds a slice of the vocabulary: gather them
        logits = table.gather_logits(logits)
    return scale.apply(logits)
