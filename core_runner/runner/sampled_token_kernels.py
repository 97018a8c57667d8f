"""Where a step's sampled tokens go, on the device: into the slot tables after sampling
(`post_update`), and into decode rows' inputs together with draft tokens (`combine_sampled_and_
draft_tokens`, for speculative decoding); a speculating step's whole verification, that update
included (`verify_and_update`). The companion of `input_kernels.py` (same conventions:
`_op_kernel` -> `op()` -> `op_ref()`, caller-owned persistent buffers, no host reads).
"""

from __future__ import annotations

import functools

import torch

from slotrunner.core_runner.runner.input_kernels import _BLOCK, _check_1d, _check_2d
from slotrunner.core_runner.spec_decode.verify import accept_drafts
from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, tl, triton, use_triton


def _put_where_(dst: torch.Tensor, indices: tuple[torch.Tensor, ...], src: torch.Tensor, valid: torch.Tensor) -> None:
    """`dst[indices] = src` where `valid` (valid targets unique), without a host sync.

    Boolean-mask indexing would read the mask's count on the host; instead masked-out lanes
    add zero at index 0 and valid lanes add (new - old), which leaves exactly `src` there.
    """
    indices = tuple(torch.where(valid, i.long(), 0) for i in indices)
    delta = torch.where(valid, src.to(dst.dtype) - dst[indices], 0).to(dst.dtype)
    dst.index_put_(indices, delta, accumulate=True)

# ---------------------------------------------------------------------------------------------
# 3. sampled and draft tokens into decode rows; logits indices


def combine_sampled_and_draft_tokens_ref(
    input_ids: torch.Tensor,  # [max_num_tokens] int64
    idx_mapping: torch.Tensor,  # [num_reqs]
    last_sampled: torch.Tensor,  # [max_slots] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    seq_lens: torch.Tensor,  # [num_reqs]
    prefill_len: torch.Tensor,  # [max_slots]
    draft_tokens: torch.Tensor,  # [max_slots, max_draft] int64
    num_draft: torch.Tensor,  # [num_reqs]
    logits_indices_out: torch.Tensor,  # [max_num_reqs * (1 + max_draft)] int64
    cu_num_logits_out: torch.Tensor | None = None,  # [max_num_reqs + 1] int32
) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        if cu_num_logits_out is not None:
            cu_num_logits_out[:1] = 0
        return
    slots = idx_mapping.long()
    num_logits = 1 + num_draft[:num_reqs].long()[:, None]  # [num_reqs, 1]
    logits_end = torch.cumsum(num_logits, dim=0)  # [num_reqs, 1]
    j = torch.arange(1 + draft_tokens.shape[1], device=input_ids.device)  # [1 + max_draft]
    in_row = j < num_logits  # [num_reqs, 1 + max_draft]
    # A row's logits are its last 1 + num_draft query tokens: the sampled token and its drafts.
    token_idx = query_start_loc[1 : num_reqs + 1].long()[:, None] - num_logits + j
    _put_where_(logits_indices_out, (logits_end - num_logits + j,), token_idx, in_row)
    tokens = torch.cat([last_sampled[slots][:, None], draft_tokens[slots]], dim=1)
    is_decode = (seq_lens[:num_reqs].long() > prefill_len.long()[slots])[:, None]
    _put_where_(input_ids, (token_idx,), tokens, in_row & is_decode)
    if cu_num_logits_out is not None:
        cu_num_logits_out[:1] = 0
        cu_num_logits_out[1 : num_reqs + 1] = logits_end[:, 0].to(cu_num_logits_out.dtype)


if HAS_TRITON:

    @jit_per_step()
    def _combine_sampled_and_draft_tokens_kernel(
        input_ids_ptr,  # [max_num_tokens]
        idx_mapping_ptr,  # [num_reqs]
        last_sampled_ptr,  # [max_slots]
        query_start_loc_ptr,  # [num_reqs + 1]
        seq_lens_ptr,  # [num_reqs]
        prefill_len_ptr,  # [max_slots]
        draft_tokens_ptr,  # [max_slots, max_draft]
        draft_tokens_stride,
        num_draft_ptr,  # [num_reqs]
        logits_indices_ptr,  # [max_num_reqs * (1 + max_draft)]
        cu_num_logits_ptr,  # [max_num_reqs + 1], only read when HAS_CU
        HAS_CU: tl.constexpr,
        SUM_BLOCK: tl.constexpr,
        ROW_BLOCK: tl.constexpr,  # >= 1 + max_draft
    ):
        row = tl.program_id(0)
        # This row's first logits index: one logit per earlier row plus that row's drafts. Each
        # program sums the earlier counts itself, so the total never visits the host.
        acc = tl.zeros([SUM_BLOCK], tl.int32)
        for start in range(0, row, SUM_BLOCK):
            offs = start + tl.arange(0, SUM_BLOCK)
            acc += tl.load(num_draft_ptr + offs, mask=offs < row, other=0).to(tl.int32)
        logits_start = row + tl.sum(acc, axis=0)
        num_logits = 1 + tl.load(num_draft_ptr + row).to(tl.int32)
        if HAS_CU:
            tl.store(cu_num_logits_ptr + row + 1, logits_start + num_logits)
            tl.store(cu_num_logits_ptr + row, logits_start, mask=row == 0)

        j = tl.arange(0, ROW_BLOCK)
        in_row = j < num_logits
        token_idx = tl.load(query_start_loc_ptr + row + 1).to(tl.int64) - num_logits + j
        tl.store(logits_indices_ptr + logits_start + j, token_idx, mask=in_row)

        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        is_decode = tl.load(seq_lens_ptr + row) > tl.load(prefill_len_ptr + slot)
        num_writes = tl.where(is_decode, num_logits, 0)  # prefill rows keep their gathered inputs
        last = tl.load(last_sampled_ptr + slot)
        drafts = tl.load(draft_tokens_ptr + slot * draft_tokens_stride + j - 1, mask=in_row & (j >= 1), other=0)
        tl.store(input_ids_ptr + token_idx, tl.where(j == 0, last, drafts), mask=j < num_writes)


def combine_sampled_and_draft_tokens(
    input_ids: torch.Tensor,  # [max_num_tokens] int64, updated in place
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    last_sampled: torch.Tensor,  # [max_slots] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32/int64
    seq_lens: torch.Tensor,  # [num_reqs] int32/int64, KV length after this step
    prefill_len: torch.Tensor,  # [max_slots] int32/int64, tokens known at admission
    draft_tokens: torch.Tensor,  # [max_slots, max_draft] int64 (max_draft may be 0)
    num_draft: torch.Tensor,  # [num_reqs] int32/int64, drafts scheduled per row
    logits_indices_out: torch.Tensor,  # [>= num_reqs * (1 + max_draft)] int64
    cu_num_logits_out: torch.Tensor | None = None,  # [>= num_reqs + 1] int32
) -> None:
    """Put each decode row's last sampled token and drafts into its query; list logits rows.

    Row r owns the last L_r = 1 + num_draft[r] query tokens; with e_r = query_start_loc[r + 1]
    and c_r = r + sum(num_draft[:r]) (the cumulative layout, by batch row):
      logits_indices_out[c_r + j] = e_r - L_r + j   for j in [0, L_r);
      cu_num_logits_out[r] = c_r, cu_num_logits_out[num_reqs] = total logits (when given);
    and when seq_lens[r] > prefill_len[slot] (the row decodes, its input is not all known):
      input_ids[e_r - L_r] = last_sampled[slot], input_ids[e_r - L_r + 1 + k] = draft_tokens[slot, k].
    Prefill rows keep the inputs gathered from the token history. Entries of logits_indices_out
    past the total are untouched: the host knows the total from the scheduled draft counts.
    """
    num_reqs = idx_mapping.shape[0]
    _check_1d(input_ids, "input_ids", 0, (torch.int64,))
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_1d(last_sampled, "last_sampled", 0, (torch.int64,))
    _check_1d(query_start_loc, "query_start_loc", num_reqs + 1)
    _check_1d(seq_lens, "seq_lens", num_reqs)
    _check_1d(prefill_len, "prefill_len", 0)
    _check_2d(draft_tokens, "draft_tokens", (torch.int64,))
    _check_1d(num_draft, "num_draft", num_reqs)
    max_draft = draft_tokens.shape[1]
    _check_1d(logits_indices_out, "logits_indices_out", num_reqs * (1 + max_draft), (torch.int64,))
    if cu_num_logits_out is not None:
        _check_1d(cu_num_logits_out, "cu_num_logits_out", num_reqs + 1, (torch.int32,))
    args = (input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len, draft_tokens, num_draft)
    if not use_triton(input_ids.device):
        combine_sampled_and_draft_tokens_ref(*args, logits_indices_out, cu_num_logits_out)
        return
    if num_reqs == 0:
        if cu_num_logits_out is not None:
            cu_num_logits_out[:1].zero_()
        return
    _combine_sampled_and_draft_tokens_kernel[(num_reqs,)](
        input_ids,
        idx_mapping,
        last_sampled,
        query_start_loc,
        seq_lens,
        prefill_len,
        draft_tokens,
        draft_tokens.stride(0),
        num_draft,
        logits_indices_out,
        logits_indices_out if cu_num_logits_out is None else cu_num_logits_out,
        HAS_CU=cu_num_logits_out is not None,
        SUM_BLOCK=_BLOCK,
        ROW_BLOCK=triton.next_power_of_2(1 + max_draft),
    )


# ---------------------------------------------------------------------------------------------
# 4. post-sampling update of the slot tables


def post_update_ref(
    idx_mapping: torch.Tensor,  # [num_reqs]
    seq_lens: torch.Tensor,  # [num_reqs] KV length after the step
    sampled: torch.Tensor,  # [num_reqs, max_sampled] int64
    num_sampled: torch.Tensor,  # [num_reqs]
    num_rejected: torch.Tensor,  # [num_reqs]
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64
    last_sampled: torch.Tensor,  # [max_slots] int64
    num_computed_tokens_slot: torch.Tensor | None = None,  # [max_slots]
) -> None:
    num_reqs = idx_mapping.shape[0]
    slots = idx_mapping.long()[:, None]  # [num_reqs, 1]
    n = num_sampled[:num_reqs].long()[:, None]
    num_computed = seq_lens[:num_reqs].long() - num_rejected[:num_reqs].long()  # [num_reqs]
    j = torch.arange(sampled.shape[1], device=sampled.device)
    # The n sampled tokens end at the new num_computed: the last one is the next input.
    cols = num_computed[:, None] - n + 1 + j  # [num_reqs, max_sampled]
    _put_where_(token_ids, (slots, cols), sampled, (j < n) & (cols < token_ids.shape[1]))
    last = sampled.gather(1, (n - 1).clamp(min=0))  # [num_reqs, 1]
    _put_where_(last_sampled, (slots,), last, n > 0)
    if num_computed_tokens_slot is not None:
        num_computed_tokens_slot[slots[:, 0]] = num_computed.to(num_computed_tokens_slot.dtype)


if HAS_TRITON:

    @jit_per_step("max_sampled")
    def _post_update_kernel(
        idx_mapping_ptr,  # [num_reqs]
        seq_lens_ptr,  # [num_reqs]
        sampled_ptr,  # [num_reqs, max_sampled]
        sampled_stride,
        num_sampled_ptr,  # [num_reqs]
        num_rejected_ptr,  # [num_reqs]
        token_ids_ptr,  # [max_slots, max_model_len]
        token_ids_stride,
        max_model_len,
        last_sampled_ptr,  # [max_slots]
        num_computed_ptr,  # [max_slots], only written when HAS_NUM_COMPUTED
        max_sampled,
        HAS_NUM_COMPUTED: tl.constexpr,
        ROW_BLOCK: tl.constexpr,  # >= max_sampled
    ):
        row = tl.program_id(0)
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        n = tl.load(num_sampled_ptr + row).to(tl.int64)
        num_computed = tl.load(seq_lens_ptr + row).to(tl.int64) - tl.load(num_rejected_ptr + row).to(tl.int64)
        j = tl.arange(0, ROW_BLOCK)
        cols = num_computed - n + 1 + j
        mask = (j < n) & (j < max_sampled) & (cols < max_model_len)
        tokens = tl.load(sampled_ptr + row * sampled_stride + j, mask=mask, other=0)
        tl.store(token_ids_ptr + slot * token_ids_stride + cols, tokens, mask=mask)
        has_sample = n > 0
        last = tl.load(sampled_ptr + row * sampled_stride + n - 1, mask=has_sample, other=0)
        tl.store(last_sampled_ptr + slot, last, mask=has_sample)
        if HAS_NUM_COMPUTED:
            tl.store(num_computed_ptr + slot, num_computed)


def post_update(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, real rows only (no padding)
    seq_lens: torch.Tensor,  # [num_reqs] int32/int64, KV length after the step (drafts included)
    sampled: torch.Tensor,  # [num_reqs, max_sampled] int64, accepted tokens first
    num_sampled: torch.Tensor,  # [num_reqs] int32/int64, 0 for a prefill chunk that stops short
    num_rejected: torch.Tensor,  # [num_reqs] int32/int64, drafts rejected (0 without drafts)
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64, updated in place
    last_sampled: torch.Tensor,  # [max_slots] int64, updated in place
    num_computed_tokens_slot: torch.Tensor | None = None,  # [max_slots] int32/int64, in place
) -> None:
    """Write sampled tokens into the slot tables on the device, without a round trip.

    With c = seq_lens[r] - num_rejected[r] (the KV length that survives rejection) and
    n = num_sampled[r]: token_ids[slot, c - n + 1 + j] = sampled[r, j] for j < n, so the
    accepted drafts land on their own positions and the bonus token at position c, the next
    step's first input (plain decode, n = 1: column seq_len). Writes at or past max_model_len
    are dropped. last_sampled[slot] = sampled[r, n - 1] when n > 0; num_computed_tokens_slot[slot] = c.
    """
    num_reqs = idx_mapping.shape[0]
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_1d(seq_lens, "seq_lens", num_reqs)
    _check_2d(sampled, "sampled", (torch.int64,))
    assert sampled.shape[0] >= num_reqs, f"sampled has {sampled.shape[0]} rows for {num_reqs} requests"
    _check_1d(num_sampled, "num_sampled", num_reqs)
    _check_1d(num_rejected, "num_rejected", num_reqs)
    _check_2d(token_ids, "token_ids", (torch.int64,))
    _check_1d(last_sampled, "last_sampled", 0, (torch.int64,))
    if num_computed_tokens_slot is not None:
        _check_1d(num_computed_tokens_slot, "num_computed_tokens_slot", 0)
    args = (idx_mapping, seq_lens, sampled, num_sampled, num_rejected, token_ids, last_sampled)
    if not use_triton(token_ids.device):
        post_update_ref(*args, num_computed_tokens_slot)
        return
    if num_reqs == 0:
        return
    _post_update_kernel[(num_reqs,)](
        idx_mapping,
        seq_lens,
        sampled,
        sampled.stride(0),
        num_sampled,
        num_rejected,
        token_ids,
        token_ids.stride(0),
        token_ids.shape[1],
        last_sampled,
        last_sampled if num_computed_tokens_slot is None else num_computed_tokens_slot,
        sampled.shape[1],
        HAS_NUM_COMPUTED=num_computed_tokens_slot is not None,
        ROW_BLOCK=triton.next_power_of_2(max(sampled.shape[1], 1)),
    )


# ---------------------------------------------------------------------------------------------
# 5. speculative verification in one op: accept, count, write the history, history lengths


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
    rejected_by_slot: torch.Tensor | None = None,  # [slots] int64: num_rejected scattered by slot, in place
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_drafts`, then the counts and `post_update`, as separate torch ops (the spec)."""
    picks, num_accepted = accept_drafts(target, draft_tokens, idx_mapping, num_draft, cu_num_logits, max_draft)
    s = samples.long()
    num_sampled = s * (num_accepted + 1)
    num_rejected = s * (num_draft.long() - num_accepted)
    post_update_ref(idx_mapping, seq_lens, picks, num_sampled, num_rejected, token_ids, last_sampled)
    if rejected_by_slot is not None:
        rejected_by_slot.index_copy_(0, idx_mapping.long(), num_rejected)
    num_known = seq_lens.long() - num_rejected + s
    return picks, num_sampled, num_rejected, num_known, torch.where(allowed, num_known, 0)


if HAS_TRITON:

    @jit_per_step("num_logits", "max_draft")
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
        rejected_by_slot_ptr,  # [slots] out (HAS_BY_SLOT)
        max_draft,
        ROW_BLOCK: tl.constexpr,  # >= 1 + max_draft
        HAS_BY_SLOT: tl.constexpr,
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
        if HAS_BY_SLOT:
            tl.store(rejected_by_slot_ptr + slot, rejected)
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


class VerifyOutputs:
    """Persistent outputs of `verify_and_update` for up to `max_rows` rows and `max_draft` drafts:
    each step's are views of the same two buffers, made once per (rows, picks a row), so a
    speculating step allocates and slices nothing for them on its host path. A step's outputs
    are read within the step (the speculator, the family's rollback, the copy packed for the
    host); the next step's verification rewrites them after, in stream order."""

    def __init__(self, max_rows: int, max_draft: int, device: torch.device) -> None:
        self._picks = torch.empty(max_rows * (1 + max_draft), dtype=torch.int64, device=device)
        # num_sampled, num_rejected, num_known, hist_len: each row 16-byte aligned whatever the row
        # count, so that these pointers (here and in the speculator's kernel) meet one Triton variant.
        self._counts = torch.empty(4, max_rows + max_rows % 2, dtype=torch.int64, device=device)
        self.views = functools.lru_cache(maxsize=None)(self._views)

    @torch.inference_mode(False)  # plain views, whoever asks first
    def _views(self, num_reqs: int, width: int) -> tuple[torch.Tensor, ...]:  # picks, then the four count rows
        return (self._picks[: num_reqs * width].view(num_reqs, width), *self._counts[:, :num_reqs])


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
    rejected_by_slot: torch.Tensor | None = None,
    out: VerifyOutputs | None = None,  # where the outputs go (else new tensors)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculating step's verification after sampling, in one launch on the GPU (a few dozen
    small torch ops otherwise: each row's accepted count, what it emits, the history write and
    the history length the speculator reads next).

    Returns (picks [num_reqs, 1 + max_draft] int64 -- row r emits picks[r, :num_sampled[r]] --,
    num_sampled [num_reqs] int64 = samples * (accepted + 1), num_rejected [num_reqs] int64 =
    samples * (num_draft - accepted), num_known [num_reqs] int64 = the history's new length, and
    hist_len [num_reqs] int64 = num_known where `allowed`, else 0). token_ids and last_sampled are updated as `post_update` does.
    With `rejected_by_slot`, each row's num_rejected is also written at its slot there (the next
    overlapped step's inputs move back by it: `build_step_inputs`); other slots keep theirs.
    With `out`, the five outputs are views of its buffers (on the GPU; the reference allocates)."""
    num_reqs = idx_mapping.shape[0]
    if not use_triton(token_ids.device):
        return verify_and_update_ref(
            target, draft_tokens, idx_mapping, num_draft, cu_num_logits, samples, seq_lens, allowed, token_ids,
            last_sampled, max_draft, rejected_by_slot,
        )  # fmt: skip
    assert target.dtype == torch.int64 and token_ids.dtype == torch.int64 and last_sampled.dtype == torch.int64
    assert rejected_by_slot is None or (rejected_by_slot.dtype == torch.int64 and rejected_by_slot.dim() == 1)
    assert allowed.dtype == torch.bool, f"allowed must be a bool tensor, got {allowed.dtype}"
    assert draft_tokens.shape[1] >= max_draft and draft_tokens.stride(1) == 1 and token_ids.stride(1) == 1
    # picks, then num_sampled, num_rejected, num_known, hist_len (VerifyOutputs' layout)
    picks, *counts = (out or VerifyOutputs(num_reqs, max_draft, token_ids.device)).views(num_reqs, 1 + max_draft)
    if num_reqs:
        _verify_and_update_kernel[(num_reqs,)](
            target, target.shape[0], draft_tokens, draft_tokens.stride(0), idx_mapping, num_draft, cu_num_logits,
            samples, seq_lens, allowed.view(torch.int8), token_ids, token_ids.stride(0), token_ids.shape[1], last_sampled,
            picks, counts[0], counts[1], counts[2], counts[3], last_sampled if rejected_by_slot is None else rejected_by_slot,
            # The tile spans the engine's draft width, not this step's largest count (the masks
            # take max_draft): one variant per engine. A step whose rows carried fewer drafts than
            # k (near max_tokens, or fewer proposed) compiled a new one mid-run, 0.14 s on one H100.
            max_draft, ROW_BLOCK=triton.next_power_of_2(1 + draft_tokens.shape[1]),
            HAS_BY_SLOT=rejected_by_slot is not None,
        )  # fmt: skip
    return picks, counts[0], counts[1], counts[2], counts[3]
