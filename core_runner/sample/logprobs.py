"""Log-probabilities of chosen tokens and the top-k, without a [rows, vocab] log-softmax.

Each row needs only its logsumexp (one reduction), the chosen token's logit, its rank (a count
of larger logits) and the top-k logits. Prompt logprobs run over many rows; they are processed
in chunks so the extra memory stays flat in the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_LOGPROBS_CHUNK = 1024  # rows of logits alive at once while computing prompt logprobs


@dataclass(frozen=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [rows, 1 + k] int64: the chosen token, then the top-k
    logprobs: torch.Tensor  # [rows, 1 + k] float32
    ranks: torch.Tensor  # [rows] int64, 1-based rank of the chosen token


def compute_logprobs_ref(
    logits: torch.Tensor,  # [rows, vocab]
    chosen: torch.Tensor,  # [rows] int64
    k: int,
) -> LogprobsTensors:
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [rows, 1]
    chosen_logit = logits.gather(1, chosen[:, None])  # [rows, 1]
    ranks = (logits > chosen_logit).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = logits.topk(k, dim=-1)
        token_ids = torch.cat([chosen[:, None], top_ids], dim=1)
        values = torch.cat([chosen_logit, top_vals], dim=1)
    else:
        token_ids, values = chosen[:, None], chosen_logit
    return LogprobsTensors(token_ids, values - lse, ranks)


def prompt_logprobs_chunked(
    hidden: torch.Tensor,  # [n, hidden] rows whose next token is a known prompt token
    targets: torch.Tensor,  # [n] int64 the next prompt token of each row
    k: int,
    compute_logits,  # hidden [m, hidden] -> logits [m, vocab]
    chunk: int = PROMPT_LOGPROBS_CHUNK,
) -> LogprobsTensors:
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        logits = compute_logits(hidden[start : start + chunk])
        parts.append(compute_logprobs_ref(logits, targets[start : start + chunk], k))
        del logits
    return LogprobsTensors(
        torch.cat([p.token_ids for p in parts]),
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.ranks for p in parts]),
    )
