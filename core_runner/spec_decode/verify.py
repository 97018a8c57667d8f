"""Exact verification: which drafts the target accepts, from the target's own picks.

The target scores each row's last token and its drafts in one forward, and the sampler picks a
token at every one of those positions exactly as it would without drafts (argmax for greedy
rows; Gumbel-max with noise keyed on seed, position and token for sampled rows). Draft j is
accepted when it equals the target's pick at its position and every draft before it was
accepted; the row then emits the target's picks at positions 0..num_accepted: the accepted
drafts (equal to the picks) and one more token, sampled at the first rejected position or after
the last draft (the bonus token). Hence the output is the same token for token as decoding one
token per step. On the device, no host reads: `accept_drafts` in torch, and `verify_and_update`
(one Triton launch on a GPU, its reference elsewhere) for the whole of a step's verification.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.runner.sampled_token_kernels import post_update_ref
from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton


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


# ---------------------------------------------------------------------------------------------
# The whole verification of a step in one op: accept, count, write the history, history lengths


def verify_and_update_ref(
    target: torch.Tensor,  # [num_logits] int64, the target's pick at every logits row
    draft_tokens: torch.Tensor,  # [slots, >= max_draft] int64
    idx_mapping: torch.Tensor,  # [num_reqs] batch row -> slot
    num_draft: torch.Tensor,  # [num_reqs] drafts scheduled per row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1]
    samples: torch.Tensor,  # [num_reqs] 1 where the row samples (its prefill is complete), else 0
    seq_lens: torch.Tensor,  # [num_reqs] KV length after the step, drafts included
    allowed: torch.Tensor,  # [num_reqs] bool, rows whose history the speculator may read
    token_ids: torch.Tensor,  # [slots, max_model_len] int64, updated in place
    last_sampled: torch.Tensor,  # [slots] int64, updated in place
    max_draft: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_drafts`, then the counts and `post_update`, as separate torch ops (the spec)."""
    picks, num_accepted = accept_drafts(target, draft_tokens, idx_mapping, num_draft, cu_num_logits, max_draft)
    s = samples.long()
    num_sampled = s * (num_accepted + 1)
    num_rejected = s * (num_draft.long() - num_accepted)
    post_update_ref(idx_mapping, seq_lens, picks, num_sampled, num_rejected, token_ids, last_sampled)
    num_known = seq_lens.long() - num_rejected + s
    return picks, num_sampled, num_rejected, num_known, torch.where(allowed, num_known, 0)


if HAS_TRITON:

    @triton.jit
    def _verify_and_update_kernel(
        target_ptr,  # [num_logits]
        num_logits,
        draft_ptr,  # [slots, >= max_draft]
        draft_stride,
        idx_mapping_ptr,  # [num_reqs]
        num_draft_ptr,  # [num_reqs]
        cu_ptr,  # [num_reqs + 1]
        samples_ptr,  # [num_reqs]
        seq_lens_ptr,  # [num_reqs]
        allowed_ptr,  # [num_reqs] int8
        token_ids_ptr,  # [slots, max_model_len]
        token_ids_stride,
        max_model_len,
        last_sampled_ptr,  # [slots]
        picks_ptr,  # [num_reqs, 1 + max_draft] out
        num_sampled_ptr,  # [num_reqs] out
        num_rejected_ptr,  # [num_reqs] out
        num_known_ptr,  # [num_reqs] out
        hist_len_ptr,  # [num_reqs] out
        max_draft,
        ROW_BLOCK: tl.constexpr,  # >= 1 + max_draft
    ):
        row = tl.program_id(0)
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        d = tl.load(num_draft_ptr + row).to(tl.int64)
        s = tl.load(samples_ptr + row).to(tl.int64)
        c0 = tl.load(cu_ptr + row).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + row).to(tl.int64)
        j = tl.arange(0, ROW_BLOCK)
        width = 1 + max_draft
        in_row = j < width
        picks = tl.load(target_ptr + tl.minimum(c0 + j, num_logits - 1), mask=in_row, other=0)
        tl.store(picks_ptr + row * width + j, picks, mask=in_row)
        drafts = tl.load(draft_ptr + slot * draft_stride + j, mask=j < tl.minimum(d, max_draft), other=0)
        # Accepted: the drafts before the first one that differs from the target's pick there.
        mismatch = (j >= d) | (j >= max_draft) | (picks != drafts)
        accepted = tl.min(tl.where(mismatch, j, ROW_BLOCK), axis=0).to(tl.int64)
        accepted = tl.minimum(accepted, d)
        n = s * (accepted + 1)
        rejected = s * (d - accepted)
        tl.store(num_sampled_ptr + row, n)
        tl.store(num_rejected_ptr + row, rejected)
        # post_update: the n emitted tokens end at the surviving KV length c.
        c = seq_len - rejected
        cols = c - n + 1 + j
        write = (j < n) & in_row & (cols < max_model_len)
        tl.store(token_ids_ptr + slot * token_ids_stride + cols, picks, mask=write)
        last = tl.sum(tl.where(j == n - 1, picks, 0), axis=0)
        tl.store(last_sampled_ptr + slot, last, mask=n > 0)
        ok = tl.load(allowed_ptr + row) != 0
        tl.store(num_known_ptr + row, c + s)
        tl.store(hist_len_ptr + row, tl.where(ok, c + s, 0))


def verify_and_update(
    target: torch.Tensor,
    draft_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_draft: torch.Tensor,
    cu_num_logits: torch.Tensor,
    samples: torch.Tensor,
    seq_lens: torch.Tensor,
    allowed: torch.Tensor,
    token_ids: torch.Tensor,
    last_sampled: torch.Tensor,
    max_draft: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculating step's verification after sampling, in one launch on the GPU (a few dozen
    small torch ops otherwise: each row's accepted count, what it emits, the history write and
    the history length the speculator reads next).

    Returns (picks [num_reqs, 1 + max_draft] int64 -- row r emits picks[r, :num_sampled[r]] --,
    num_sampled [num_reqs] int64 = samples * (accepted + 1), num_rejected [num_reqs] int64 =
    samples * (num_draft - accepted), num_known [num_reqs] int64 = the history's new length, and
    hist_len [num_reqs] int64 = num_known where `allowed`, else 0). token_ids and last_sampled are updated as `post_update` does."""
    num_reqs = idx_mapping.shape[0]
    if not use_triton(token_ids.device):
        return verify_and_update_ref(
            target, draft_tokens, idx_mapping, num_draft, cu_num_logits, samples, seq_lens, allowed, token_ids,
            last_sampled, max_draft,
        )  # fmt: skip
    assert target.dtype == torch.int64 and token_ids.dtype == torch.int64 and last_sampled.dtype == torch.int64
    assert draft_tokens.shape[1] >= max_draft and draft_tokens.stride(1) == 1 and token_ids.stride(1) == 1
    device = token_ids.device
    picks = torch.empty(num_reqs, 1 + max_draft, dtype=torch.int64, device=device)
    counts = torch.empty(4, num_reqs, dtype=torch.int64, device=device)  # num_sampled, num_rejected, num_known, hist_len
    if num_reqs:
        _verify_and_update_kernel[(num_reqs,)](
            target, target.shape[0], draft_tokens, draft_tokens.stride(0), idx_mapping, num_draft, cu_num_logits,
            samples, seq_lens, allowed.to(torch.int8), token_ids, token_ids.stride(0), token_ids.shape[1], last_sampled,
            picks, counts[0], counts[1], counts[2], counts[3], max_draft, ROW_BLOCK=triton.next_power_of_2(1 + max_draft),
        )  # fmt: skip
    return picks, counts[0], counts[1], counts[2], counts[3]
