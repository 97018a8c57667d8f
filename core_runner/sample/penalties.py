"""Repetition, frequency and presence penalties, counted from the slots' token history."""

from __future__ import annotations

import torch

from slotrunner.core_runner.sample.sampling_states import PenaltyParams


def apply_penalties_ref(
    logits: torch.Tensor,  # [rows, vocab] float32, modified in place for penalized rows
    p: PenaltyParams,
    token_ids: torch.Tensor,  # [slots, max_model_len] the runner's token history
    prompt_len: torch.Tensor,  # [num_penalized] int64
    num_tokens: torch.Tensor,  # [num_penalized] int64, tokens in the history (prompt + output)
) -> torch.Tensor:
    """vLLM semantics: repetition penalty over prompt + output tokens (logit / p if positive,
    * p if negative), frequency (count) and presence (seen) penalties over output tokens only."""
    vocab = logits.shape[-1]
    max_len = int(num_tokens.max())
    hist = token_ids.index_select(0, p.slots)[:, :max_len]  # [n, max_len]
    pos = torch.arange(max_len, device=logits.device)[None, :]
    is_output = (pos >= prompt_len[:, None]) & (pos < num_tokens[:, None])
    is_prompt = pos < prompt_len[:, None]
    out_counts = torch.zeros(hist.shape[0], vocab, device=logits.device).scatter_add_(1, hist, is_output.float())
    prompt_seen = torch.zeros(hist.shape[0], vocab, device=logits.device).scatter_add_(1, hist, is_prompt.float()) > 0
    seen = prompt_seen | (out_counts > 0)
    rows = logits.index_select(0, p.rows)
    rep = p.repetition[:, None]
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows = rows - p.frequency[:, None] * out_counts - p.presence[:, None] * (out_counts > 0).float()
    logits.index_copy_(0, p.rows, rows)
    return logits
