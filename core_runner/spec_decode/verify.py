"""Exact verification: which drafts the target accepts, from the target's own picks.

The target scores each row's last token and its drafts in one forward, and the sampler picks a
token at every one of those positions exactly as it would without drafts (argmax for greedy
rows; Gumbel-max with noise keyed on seed, position and token for sampled rows). Draft j is
accepted when it equals the target's pick at its position and every draft before it was
accepted; the row then emits the target's picks at positions 0..num_accepted: the accepted
drafts (equal to the picks) and one more token, sampled at the first rejected position or after
the last draft (the bonus token). Hence the output is the same token for token as decoding one
token per step. Pure torch on the device, no host reads; the runner's `verify_and_update`
(`runner/sampled_token_kernels.py`) does all of a step's verification in one launch on a GPU.
"""

from __future__ import annotations

import torch



def accept_drafts(
    target: torch.Tensor,  # [num_logits] int64, the target's pick at every logits row (rows in cumulative layout)
    draft_tokens: torch.Tensor,  # [slots, >= max_draft] int64
    idx_mapping: torch.Tensor,  # [num_reqs] batch row -> slot
    num_draft: torch.Tensor,  # [num_reqs] drafts scheduled per row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] row r's logits rows are [cu[r], cu[r + 1])
    max_draft: int,  # host bound on num_draft (sizes the outputs)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (picks [num_reqs, 1 + max_draft] int64, num_accepted [num_reqs] int64): row r
    emits picks[r, :num_accepted[r] + 1]. Entries past a row's 1 + num_draft are padding."""
    num_reqs = idx_mapping.shape[0]
    j = torch.arange(1 + max_draft, device=target.device)
    rows = (cu_num_logits[:num_reqs].long()[:, None] + j).clamp(max=max(target.shape[0] - 1, 0))
    picks = target[rows]  # [num_reqs, 1 + max_draft]
    if max_draft == 0:
        return picks, torch.zeros(num_reqs, dtype=torch.int64, device=target.device)
    drafts = draft_tokens[idx_mapping.long(), :max_draft]
    match = (picks[:, :max_draft] == drafts) & (j[:max_draft] < num_draft.long()[:, None])
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    return picks, num_accepted
