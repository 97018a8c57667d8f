"""Sampler: temperature -> top-k / top-p / min-p -> Gumbel-max, per logits row."""

from __future__ import annotations

import torch

from slotrunner.core_runner.sample.filters import apply_top_k_top_p_min_p
from slotrunner.core_runner.sample.gumbel import gumbel_sample_ref
from slotrunner.core_runner.sample.sampling_states import BatchSamplingParams


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        params: BatchSamplingParams,
        positions: torch.Tensor,  # [rows] int64, position each sampled token will take
    ) -> torch.Tensor:  # [rows] int64
        if params.all_greedy:
            return logits.argmax(dim=-1)
        logits = logits.float()
        greedy = params.temperature == 0
        t = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
        scaled = logits / t[:, None]
        if params.top_k is not None or params.top_p is not None or params.min_p is not None:
            scaled = apply_top_k_top_p_min_p(scaled, params.top_k, params.top_p, params.min_p)
        # Greedy rows keep their raw logits (argmax is unaffected by filters or scaling).
        scaled = torch.where(greedy[:, None], logits, scaled)
        return gumbel_sample_ref(scaled, greedy, params.seeds, positions)
