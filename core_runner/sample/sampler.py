"""Sampler: the per-row pipeline from logits to one token (plus logprobs when asked).

    raw logits -> logprobs of the raw distribution (rows that ask)
    -> allowed-token mask, logit bias, bans (bad words, stop tokens before min_tokens)
    -> penalties (repetition, frequency, presence)
    -> greedy rows: argmax
    -> sampled rows: / temperature -> top-k / top-p / min-p -> Gumbel-max

Every stage after the first is skipped when no row of the batch uses it (decided on the host
when the batch parameters are gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotrunner.core_runner.sample.filters import apply_top_k_top_p_min_p
from slotrunner.core_runner.sample.gumbel import gumbel_sample
from slotrunner.core_runner.sample.logprobs import LogprobsTensors, compute_logprobs_ref
from slotrunner.core_runner.sample.penalties import apply_penalties_ref
from slotrunner.core_runner.sample.sampling_states import BatchSamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """What penalties read: the runner's token table and each penalized row's lengths."""

    token_ids: torch.Tensor  # [slots, max_model_len]
    prompt_len: torch.Tensor  # [num_penalized] int64
    num_tokens: torch.Tensor  # [num_penalized] int64


@dataclass(frozen=True)
class SamplerOutput:
    sampled: torch.Tensor  # [rows] int64
    logprobs: LogprobsTensors | None  # rows x (1 + max k), when any row asked


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        params: BatchSamplingParams,
        positions: torch.Tensor,  # [rows] int32/int64, position each sampled token will take (keys its noise)
        history: TokenHistory | None = None,  # required when params.penalties is set
    ) -> SamplerOutput:
        raw = logits
        logits = self.process(logits, params, history)
        if params.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            scaled = logits.float() / params.temperature[:, None]  # greedy rows: / 1
            if params.top_k is not None or params.top_p is not None or params.min_p is not None:
                scaled = apply_top_k_top_p_min_p(scaled, params.top_k, params.top_p, params.min_p, params.max_top_k)
            if params.greedy is not None:
                # Greedy rows keep the processed, unscaled logits: their argmax ignores the filters.
                scaled = torch.where(params.greedy[:, None], logits.float(), scaled)
            sampled = gumbel_sample(scaled, params.greedy, params.seeds, positions)
        logprobs = None
        if params.max_num_logprobs >= 0:
            logprobs = compute_logprobs_ref(raw, sampled, params.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def process(logits: torch.Tensor, params: BatchSamplingParams, history: TokenHistory | None) -> torch.Tensor:
        """Allowed mask, bias and bans, penalties; returns float32 logits (a copy when changed)."""
        if params.allowed_mask is None and params.bias is None and params.penalties is None:
            return logits
        logits = logits.float().clone()
        if params.allowed_mask is not None:
            logits.masked_fill_(~params.allowed_mask, float("-inf"))
        if params.bias is not None:
            b = params.bias
            logits.index_put_((b.rows, b.tokens), b.values, accumulate=True)
        if params.penalties is not None:
            assert history is not None, "penalties need the token history"
            apply_penalties_ref(logits, params.penalties, history.token_ids, history.prompt_len, history.num_tokens)
        return logits
