"""Top-k, top-p and min-p filters on temperature-scaled logits (set excluded tokens to -inf)."""

from __future__ import annotations

import math

import torch


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [rows, vocab] float32, already divided by temperature
    top_k: torch.Tensor | None,  # [rows] int64, <= 0 means off
    top_p: torch.Tensor | None,  # [rows] float32, 1 means off
    min_p: torch.Tensor | None,  # [rows] float32, 0 means off
    max_top_k: int | None = None,  # the host's max of top_k (<= 0 counting as the vocabulary)
) -> torch.Tensor:
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        # The k-th largest logit of each row; ties at the threshold stay in. The host knows the
        # largest k: reading it from the device would stall the step.
        max_k = min(max_top_k, vocab) if max_top_k is not None else int(k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does. The top token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
        log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-30).log(), torch.full_like(min_p, -math.inf))
        threshold = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits
