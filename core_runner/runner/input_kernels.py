"""Input-preparation kernels: one step's inputs built on the device from the per-slot tables.

Every op reads persistent per-slot tables through `idx_mapping` (batch row -> slot) and writes
into caller-owned buffers sized for the largest batch, so a CUDA graph sees fixed addresses.
No op reads device data on the host: launch grids depend only on host ints (row counts, padded
sizes), and lengths that live on the device (`query_start_loc[num_reqs]`, the cumulative
logits count) are read inside the kernels. The references keep the same rule (no `.item()`,
no boolean-mask indexing), so they are safe to compare against on a GPU as well.

Order within a step: prepare_input_ids_positions -> combine_sampled_and_draft_tokens (overwrites
decode rows' inputs) -> prepare_seq_lens, compute_slot_mapping (reads positions),
gather_block_tables -> forward -> sampling -> post_update.

Each op: `_op_kernel` (Triton) -> `op()` (checks, dispatch through `use_triton`) -> `op_ref()`
(torch specification). The six ops live together because they are one concept, the step's
input preparation, and their references share the token -> batch row helper.

Preconditions the wrappers cannot check without reading the device (the scheduler guarantees
them): `query_start_loc` is non-decreasing with `query_start_loc[0] == 0`;
`query_start_loc[num_reqs] <= num_tokens_padded`; every position is `< max_model_len`; block
table entries cover every position; `num_draft[r] <= max_draft` and a row's query holds at
least `1 + num_draft[r]` tokens.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

_INT = (torch.int32, torch.int64)
_BLOCK = 1024  # lanes per loop iteration: token loops, prefix sums, block-table columns


def _check_1d(t: torch.Tensor, name: str, min_len: int, dtypes: tuple[torch.dtype, ...] = _INT) -> None:
    assert t.dim() == 1 and t.dtype in dtypes and t.is_contiguous() and t.numel() >= min_len, (
        f"{name}: want a contiguous 1-D tensor of >= {min_len} elements, dtype in {dtypes}; "
        f"got shape {tuple(t.shape)}, {t.dtype}, strides {t.stride()}"
    )


def _check_2d(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    assert t.dim() == 2 and t.dtype in dtypes and t.stride(-1) == 1, (
        f"{name}: want a 2-D tensor with unit column stride, dtype in {dtypes}; "
        f"got shape {tuple(t.shape)}, {t.dtype}, strides {t.stride()}"
    )


def _token_rows(
    query_start_loc: torch.Tensor,  # [>= num_reqs + 1], num_reqs >= 1
    num_reqs: int,
    num_tokens_padded: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # 3 x [num_tokens_padded]
    """(batch row, offset in the row's query, is a real token) for each token slot.

    Padding tokens (past `query_start_loc[num_reqs]`) report the last row and `real` False.
    Empty rows own no token: no t satisfies start <= t < end.
    """
    device = query_start_loc.device
    t = torch.arange(num_tokens_padded, device=device, dtype=torch.int64)
    rows = torch.searchsorted(query_start_loc[1 : num_reqs + 1].long(), t, right=True)
    real = rows < num_reqs
    rows = rows.clamp_(max=num_reqs - 1)
    return rows, real, t - query_start_loc.long()[rows]


def _put_where_(dst: torch.Tensor, indices: tuple[torch.Tensor, ...], src: torch.Tensor, valid: torch.Tensor) -> None:
    """`dst[indices] = src` where `valid` (valid targets unique), without a host sync.

    Boolean-mask indexing would read the mask's count on the host; instead masked-out lanes
    add zero at index 0 and valid lanes add (new - old), which leaves exactly `src` there.
    """
    indices = tuple(torch.where(valid, i.long(), 0) for i in indices)
    delta = torch.where(valid, src.to(dst.dtype) - dst[indices], 0).to(dst.dtype)
    dst.index_put_(indices, delta, accumulate=True)


# ---------------------------------------------------------------------------------------------
# 1. input ids and positions


def prepare_input_ids_positions_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # [num_reqs] per batch row, tokens already in the KV cache
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64, per-slot token history
    input_ids_out: torch.Tensor,  # [max_num_tokens] int64
    positions_out: torch.Tensor,  # [max_num_tokens] int64
    num_tokens_padded: int,
) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        input_ids_out[:num_tokens_padded] = 0
        positions_out[:num_tokens_padded] = 0
        return
    rows, real, offsets = _token_rows(query_start_loc, num_reqs, num_tokens_padded)
    positions = num_computed_tokens.long()[rows] + offsets
    ids = token_ids[idx_mapping.long()[rows], positions.clamp(0, token_ids.shape[1] - 1)]
    positions_out[:num_tokens_padded] = torch.where(real, positions, 0)
    input_ids_out[:num_tokens_padded] = torch.where(real, ids, 0)


if HAS_TRITON:

    @triton.jit
    def _prepare_input_ids_positions_kernel(
        idx_mapping_ptr,  # [num_reqs]
        query_start_loc_ptr,  # [num_reqs + 1]
        num_computed_ptr,  # [num_reqs]
        token_ids_ptr,  # [max_slots, max_model_len]
        token_ids_stride,
        input_ids_ptr,  # [max_num_tokens]
        positions_ptr,  # [max_num_tokens]
        num_reqs,
        num_tokens_padded,
        BLOCK: tl.constexpr,
    ):
        # Programs 0..num_reqs-1 fill one row's query each; program num_reqs zeroes the padding.
        row = tl.program_id(0)
        if row == num_reqs:
            # int32 loop bounds throughout: query_start_loc may be int64, loop bounds must agree.
            num_tokens = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32)
            for start in range(num_tokens, num_tokens_padded, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                pad = offs < num_tokens_padded
                tl.store(input_ids_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=pad)
                tl.store(positions_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=pad)
        else:
            slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
            query_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
            query_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - query_start
            num_computed = tl.load(num_computed_ptr + row).to(tl.int64)
            for i in range(0, query_len, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                in_query = offs < query_len
                pos = num_computed + offs
                ids = tl.load(token_ids_ptr + slot * token_ids_stride + pos, mask=in_query, other=0)
                tl.store(input_ids_ptr + query_start + offs, ids, mask=in_query)
                tl.store(positions_ptr + query_start + offs, pos, mask=in_query)


def prepare_input_ids_positions(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32/int64 (a longer buffer is fine)
    num_computed_tokens: torch.Tensor,  # [num_reqs] int32/int64, per batch row
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64, per-slot token history
    input_ids_out: torch.Tensor,  # [max_num_tokens] int64, written in [0, num_tokens_padded)
    positions_out: torch.Tensor,  # [max_num_tokens] int64, written in [0, num_tokens_padded)
    num_tokens_padded: int,
) -> None:
    """Query token i of row r: position num_computed[r] + i, input id token_ids[slot, position].

    Tokens in [num_tokens, num_tokens_padded) (CUDA-graph padding) get position 0 and id 0,
    so a padded forward reads valid memory; entries past num_tokens_padded are untouched.
    """
    num_reqs = idx_mapping.shape[0]
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_1d(query_start_loc, "query_start_loc", num_reqs + 1)
    _check_1d(num_computed_tokens, "num_computed_tokens", num_reqs)
    _check_2d(token_ids, "token_ids", (torch.int64,))
    _check_1d(input_ids_out, "input_ids_out", num_tokens_padded, (torch.int64,))
    _check_1d(positions_out, "positions_out", num_tokens_padded, (torch.int64,))
    if not use_triton(input_ids_out.device):
        prepare_input_ids_positions_ref(
            idx_mapping, query_start_loc, num_computed_tokens, token_ids, input_ids_out, positions_out, num_tokens_padded
        )
        return
    _prepare_input_ids_positions_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        token_ids,
        token_ids.stride(0),
        input_ids_out,
        positions_out,
        num_reqs,
        num_tokens_padded,
        BLOCK=_BLOCK,
    )


# ---------------------------------------------------------------------------------------------
# 2. sequence lengths


def prepare_seq_lens_ref(
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # [num_reqs]
    seq_lens_out: torch.Tensor,  # [max_num_reqs] int32
    num_reqs_padded: int,
) -> None:
    num_reqs = num_computed_tokens.shape[0]
    query_lens = query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]
    seq_lens_out[:num_reqs] = num_computed_tokens + query_lens
    seq_lens_out[num_reqs:num_reqs_padded] = 0


if HAS_TRITON:

    @triton.jit
    def _prepare_seq_lens_kernel(
        query_start_loc_ptr,  # [num_reqs + 1]
        num_computed_ptr,  # [num_reqs]
        seq_lens_ptr,  # [max_num_reqs] int32
        num_reqs,
        num_reqs_padded,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        real = rows < num_reqs
        query_len = tl.load(query_start_loc_ptr + rows + 1, mask=real, other=0) - tl.load(
            query_start_loc_ptr + rows, mask=real, other=0
        )
        num_computed = tl.load(num_computed_ptr + rows, mask=real, other=0)
        tl.store(seq_lens_ptr + rows, (num_computed + query_len).to(tl.int32), mask=rows < num_reqs_padded)


def prepare_seq_lens(
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32/int64 (a longer buffer is fine)
    num_computed_tokens: torch.Tensor,  # [num_reqs] int32/int64, per batch row; defines num_reqs
    seq_lens_out: torch.Tensor,  # [max_num_reqs] int32, written in [0, num_reqs_padded)
    num_reqs_padded: int,
) -> None:
    """seq_len[r] = num_computed[r] + query_len[r], the KV length after this step.

    Rows in [num_reqs, num_reqs_padded) get 0, so padded graph rows attend to nothing.
    """
    num_reqs = num_computed_tokens.shape[0]
    assert num_reqs <= num_reqs_padded, f"num_reqs_padded {num_reqs_padded} < num_reqs {num_reqs}"
    _check_1d(query_start_loc, "query_start_loc", num_reqs + 1)
    _check_1d(num_computed_tokens, "num_computed_tokens", num_reqs)
    _check_1d(seq_lens_out, "seq_lens_out", num_reqs_padded, (torch.int32,))
    if not use_triton(seq_lens_out.device):
        prepare_seq_lens_ref(query_start_loc, num_computed_tokens, seq_lens_out, num_reqs_padded)
        return
    if num_reqs_padded == 0:
        return
    _prepare_seq_lens_kernel[(triton.cdiv(num_reqs_padded, _BLOCK),)](
        query_start_loc, num_computed_tokens, seq_lens_out, num_reqs, num_reqs_padded, BLOCK=_BLOCK
    )


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

    @triton.jit
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

    @triton.jit
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
# 5. KV-cache slot of each query token


def compute_slot_mapping_ref(
    idx_mapping: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    positions: torch.Tensor,  # [max_num_tokens]
    block_table: torch.Tensor,  # [max_slots, max_blocks] int32, slot-indexed
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [max_num_tokens] int64
    num_tokens_padded: int,
) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        slot_mapping_out[:num_tokens_padded] = -1
        return
    rows, real, _ = _token_rows(query_start_loc, num_reqs, num_tokens_padded)
    pos = positions[:num_tokens_padded].long()
    blocks = block_table[idx_mapping.long()[rows], (pos // block_size).clamp(0, block_table.shape[1] - 1)]
    slot_mapping_out[:num_tokens_padded] = torch.where(real, blocks.long() * block_size + pos % block_size, -1)


if HAS_TRITON:

    @triton.jit
    def _compute_slot_mapping_kernel(
        idx_mapping_ptr,  # [num_reqs]
        query_start_loc_ptr,  # [num_reqs + 1]
        positions_ptr,  # [max_num_tokens]
        block_table_ptr,  # [max_slots, max_blocks]
        block_table_stride,
        slot_mapping_ptr,  # [max_num_tokens]
        num_reqs,
        num_tokens_padded,
        KV_BLOCK_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Programs 0..num_reqs-1 map one row's tokens each; program num_reqs marks the padding.
        row = tl.program_id(0)
        if row == num_reqs:
            num_tokens = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32)
            for start in range(num_tokens, num_tokens_padded, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(slot_mapping_ptr + offs, tl.full([BLOCK], -1, tl.int64), mask=offs < num_tokens_padded)
        else:
            slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
            query_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
            query_end = tl.load(query_start_loc_ptr + row + 1).to(tl.int32)
            for start in range(query_start, query_end, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                in_query = offs < query_end
                pos = tl.load(positions_ptr + offs, mask=in_query, other=0).to(tl.int64)
                block_ids = tl.load(
                    block_table_ptr + slot * block_table_stride + pos // KV_BLOCK_SIZE, mask=in_query, other=0
                ).to(tl.int64)
                tl.store(slot_mapping_ptr + offs, block_ids * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE, mask=in_query)


def compute_slot_mapping(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32/int64
    positions: torch.Tensor,  # [max_num_tokens] int32/int64
    block_table: torch.Tensor,  # [max_slots, max_blocks] int32, slot-indexed persistent table
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [max_num_tokens] int64, written in [0, num_tokens_padded)
    num_tokens_padded: int,
) -> None:
    """Flat KV-cache slot of each query token: block_table[slot, pos // bs] * bs + pos % bs.

    Padding tokens get -1: the attention write must skip them, or it would clobber block 0.
    """
    num_reqs = idx_mapping.shape[0]
    assert block_size > 0, f"block_size {block_size}"
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_1d(query_start_loc, "query_start_loc", num_reqs + 1)
    _check_1d(positions, "positions", 0)
    _check_2d(block_table, "block_table", (torch.int32, torch.int64))
    _check_1d(slot_mapping_out, "slot_mapping_out", num_tokens_padded, (torch.int64,))
    if not use_triton(slot_mapping_out.device):
        compute_slot_mapping_ref(
            idx_mapping, query_start_loc, positions, block_table, block_size, slot_mapping_out, num_tokens_padded
        )
        return
    _compute_slot_mapping_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        positions,
        block_table,
        block_table.stride(0),
        slot_mapping_out,
        num_reqs,
        num_tokens_padded,
        KV_BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
    )


# ---------------------------------------------------------------------------------------------
# 6. block-table rows of this step's batch


def gather_block_tables_ref(
    idx_mapping: torch.Tensor,  # [num_reqs]
    block_table: torch.Tensor,  # [max_slots, max_blocks] int32
    out: torch.Tensor,  # [max_num_reqs, max_blocks] int32
    num_reqs_padded: int,
    max_num_blocks_needed: int | None = None,
) -> None:
    num_reqs = idx_mapping.shape[0]
    cols = block_table.shape[1] if max_num_blocks_needed is None else max_num_blocks_needed
    out[:num_reqs, :cols] = block_table[idx_mapping.long(), :cols]
    out[num_reqs:num_reqs_padded, :cols] = 0


if HAS_TRITON:

    @triton.jit
    def _gather_block_tables_kernel(
        idx_mapping_ptr,  # [num_reqs]
        block_table_ptr,  # [max_slots, max_blocks]
        block_table_stride,
        out_ptr,  # [max_num_reqs, max_blocks]
        out_stride,
        num_reqs,
        num_cols,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        real = row < num_reqs
        slot = tl.load(idx_mapping_ptr + row, mask=real, other=0).to(tl.int64)
        # A padded row reads nothing (limit 0) and so stores zeros. (A scalar limit rather than
        # `in_cols & real`: the interpreter rejects block & scalar masks.)
        read_cols = tl.where(real, num_cols, 0)
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ids = tl.load(block_table_ptr + slot * block_table_stride + cols, mask=cols < read_cols, other=0)
            tl.store(out_ptr + row * out_stride + cols, ids, mask=cols < num_cols)


def gather_block_tables(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    block_table: torch.Tensor,  # [max_slots, max_blocks] int32, slot-indexed persistent table
    out: torch.Tensor,  # [max_num_reqs, max_blocks] int32, rows [0, num_reqs_padded) written
    num_reqs_padded: int,
    max_num_blocks_needed: int | None = None,
) -> None:
    """out[r] = block_table[idx_mapping[r]]; padded rows are zero (block 0, never read).

    With `max_num_blocks_needed` (a host bound, e.g. cdiv(max_seq_len, block_size)) only the
    first that many columns are written; later columns keep stale ids the attention never reads.
    """
    num_reqs = idx_mapping.shape[0]
    assert num_reqs <= num_reqs_padded, f"num_reqs_padded {num_reqs_padded} < num_reqs {num_reqs}"
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_2d(block_table, "block_table", (torch.int32,))
    _check_2d(out, "out", (torch.int32,))
    cols = block_table.shape[1] if max_num_blocks_needed is None else max_num_blocks_needed
    assert 0 <= cols <= min(block_table.shape[1], out.shape[1]) and out.shape[0] >= num_reqs_padded, (
        f"out {tuple(out.shape)} cannot hold {num_reqs_padded} rows x {cols} columns of {tuple(block_table.shape)}"
    )
    if not use_triton(out.device):
        gather_block_tables_ref(idx_mapping, block_table, out, num_reqs_padded, max_num_blocks_needed)
        return
    if num_reqs_padded == 0:
        return
    _gather_block_tables_kernel[(num_reqs_padded,)](
        idx_mapping, block_table, block_table.stride(0), out, out.stride(0), num_reqs, cols, BLOCK=_BLOCK
    )
