"""Input-preparation kernels: one step's inputs built on the device from the per-slot tables.

Every op reads persistent per-slot tables through `idx_mapping` (batch row -> slot) and writes
into caller-owned buffers sized for the largest batch, so a CUDA graph sees fixed addresses.
No op reads device data on the host: launch grids depend only on host ints (row counts, padded
sizes), and lengths that live on the device (`query_start_loc[num_reqs]`, the cumulative
logits count) are read inside the kernels. The references keep the same rule (no `.item()`,
no boolean-mask indexing), so they are safe to compare against on a GPU as well.

Order within a step: build_step_inputs (input ids, positions, each KV-cache group's slot mapping
and block-table rows: one launch) -> combine_sampled_and_draft_tokens (overwrites decode rows'
input ids; positions and slots stay) -> forward -> sampling -> post_update. Sequence lengths need
no op: the host knows them and stages them with the step's other small inputs
(InputBuffers.stage). The two ops about sampled tokens (combine, post_update) are in
`sampled_token_kernels.py` and share this file's helpers.

Each op: `_op_kernel` (Triton) -> `op()` (checks, dispatch through `use_triton`) -> `op_ref()`
(torch specification). build_step_inputs' specification is three references, each pinned on
examples by hand in the tests: prepare_input_ids_positions_ref, compute_slot_mapping_ref and
gather_block_tables_ref.

Preconditions the wrappers cannot check without reading the device (the scheduler guarantees
them): `query_start_loc` is non-decreasing with `query_start_loc[0] == 0`;
`query_start_loc[num_reqs] <= num_tokens_padded`; every position is `< max_model_len`; block
table entries cover every position; `num_draft[r] <= max_draft` and a row's query holds at
least `1 + num_draft[r]` tokens.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, tl, use_triton

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


# ---------------------------------------------------------------------------------------------
# The references: input ids and positions; the KV-cache slot of each query token; the
# block-table rows of this step's batch.


def prepare_input_ids_positions_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # [num_reqs] per batch row, tokens already in the KV cache
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64, per-slot token history
    input_ids_out: torch.Tensor,  # [max_num_tokens] int64
    positions_out: torch.Tensor,  # [max_num_tokens] int64
    num_tokens_padded: int,
    rejected_by_slot: torch.Tensor | None = None,  # [max_slots]: see build_step_inputs
    seq_lens: torch.Tensor | None = None,  # [num_reqs], with rejected_by_slot
    num_back_rows: int = 0,
) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_back_rows:
        back = rejected_by_slot[idx_mapping[:num_back_rows].long()]
        num_computed_tokens[:num_back_rows] -= back.to(num_computed_tokens.dtype)
        seq_lens[:num_back_rows] -= back.to(seq_lens.dtype)
    if num_reqs == 0:
        input_ids_out[:num_tokens_padded] = 0
        positions_out[:num_tokens_padded] = 0
        return
    rows, real, offsets = _token_rows(query_start_loc, num_reqs, num_tokens_padded)
    positions = num_computed_tokens.long()[rows] + offsets
    ids = token_ids[idx_mapping.long()[rows], positions.clamp(0, token_ids.shape[1] - 1)]
    positions_out[:num_tokens_padded] = torch.where(real, positions, 0)
    input_ids_out[:num_tokens_padded] = torch.where(real, ids, 0)


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


def build_step_inputs_ref(  # the arguments of build_step_inputs
    idx_mapping: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # [num_reqs]
    token_ids: torch.Tensor,  # [max_slots, max_model_len]
    input_ids_out: torch.Tensor,  # [max_num_tokens]
    positions_out: torch.Tensor,  # [max_num_tokens]
    num_tokens_padded: int,
    block_tables: torch.Tensor,  # [groups, max_slots, max_blocks]
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [groups, max_num_tokens]
    block_tables_out: torch.Tensor,  # [groups, max_num_reqs, max_blocks]
    num_reqs_padded: int,
    max_num_blocks_needed: int | None = None,
    rejected_by_slot: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    num_back_rows: int = 0,
) -> None:
    prepare_input_ids_positions_ref(
        idx_mapping, query_start_loc, num_computed_tokens, token_ids, input_ids_out, positions_out, num_tokens_padded,
        rejected_by_slot, seq_lens, num_back_rows,
    )  # fmt: skip
    for g in range(block_tables.shape[0]):
        compute_slot_mapping_ref(
            idx_mapping, query_start_loc, positions_out, block_tables[g], block_size, slot_mapping_out[g], num_tokens_padded
        )
        gather_block_tables_ref(idx_mapping, block_tables[g], block_tables_out[g], num_reqs_padded, max_num_blocks_needed)


if HAS_TRITON:

    @jit_per_step("num_reqs", "num_tokens_padded", "num_reqs_padded", "num_cols", "num_back_rows")
    def _build_step_inputs_kernel(
        idx_mapping_ptr,  # [num_reqs]
        query_start_loc_ptr,  # [num_reqs + 1]
        num_computed_ptr,  # [num_reqs]
        token_ids_ptr,  # [max_slots, max_model_len]
        token_ids_stride,
        input_ids_ptr,  # [max_num_tokens]
        positions_ptr,  # [max_num_tokens]
        table_ptr,  # [groups, max_slots, max_blocks]
        table_group_stride,
        table_stride,
        slot_mapping_ptr,  # [groups, max_num_tokens]
        slot_mapping_group_stride,
        tables_out_ptr,  # [groups, max_num_reqs, max_blocks]
        tables_out_group_stride,
        tables_out_stride,
        num_reqs,
        num_tokens_padded,
        num_reqs_padded,
        num_cols,
        rejected_ptr,  # [max_slots] (HAS_BACK)
        seq_lens_ptr,  # [num_reqs] (HAS_BACK)
        num_back_rows,
        NUM_GROUPS: tl.constexpr,
        KV_BLOCK_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_BACK: tl.constexpr,
    ):
        # Program r < num_reqs fills row r's query tokens (ids, positions, each group's slots);
        # program num_reqs marks the padding tokens; every program r < num_reqs_padded writes
        # row r of each group's block table (zeros on padding rows).
        row = tl.program_id(0)
        if row < num_reqs:
            slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
            # int32 loop bounds throughout: query_start_loc may be int64, loop bounds must agree.
            query_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
            query_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - query_start
            num_computed = tl.load(num_computed_ptr + row).to(tl.int64)
            if HAS_BACK:
                if row < num_back_rows:  # the row starts back by its drafts the last step rejected
                    back = tl.load(rejected_ptr + slot).to(tl.int64)
                    num_computed -= back
                    tl.store(num_computed_ptr + row, num_computed.to(num_computed_ptr.dtype.element_ty))
                    seq_len = tl.load(seq_lens_ptr + row).to(tl.int64) - back
                    tl.store(seq_lens_ptr + row, seq_len.to(seq_lens_ptr.dtype.element_ty))
            for i in range(0, query_len, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                in_query = offs < query_len
                pos = num_computed + offs
                ids = tl.load(token_ids_ptr + slot * token_ids_stride + pos, mask=in_query, other=0)
                tl.store(input_ids_ptr + query_start + offs, ids, mask=in_query)
                tl.store(positions_ptr + query_start + offs, pos, mask=in_query)
                for g in tl.static_range(NUM_GROUPS):
                    block_ids = tl.load(
                        table_ptr + g * table_group_stride + slot * table_stride + pos // KV_BLOCK_SIZE, mask=in_query, other=0
                    ).to(tl.int64)
                    tl.store(
                        slot_mapping_ptr + g * slot_mapping_group_stride + query_start + offs,
                        block_ids * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE,
                        mask=in_query,
                    )
        if row == num_reqs:
            num_tokens = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32)  # 0 when num_reqs is 0
            for start in range(num_tokens, num_tokens_padded, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                pad = offs < num_tokens_padded
                tl.store(input_ids_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=pad)
                tl.store(positions_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=pad)
                for g in tl.static_range(NUM_GROUPS):
                    tl.store(slot_mapping_ptr + g * slot_mapping_group_stride + offs, tl.full([BLOCK], -1, tl.int64), mask=pad)
        if row < num_reqs_padded:
            real = row < num_reqs
            row_slot = tl.load(idx_mapping_ptr + row, mask=real, other=0).to(tl.int64)
            # A padded row reads nothing (limit 0) and so stores zeros. (A scalar limit rather than
            # `in_cols & real`: the interpreter rejects block & scalar masks.)
            read_cols = tl.where(real, num_cols, 0)
            for start in range(0, num_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                for g in tl.static_range(NUM_GROUPS):
                    ids = tl.load(table_ptr + g * table_group_stride + row_slot * table_stride + cols, mask=cols < read_cols, other=0)
                    tl.store(tables_out_ptr + g * tables_out_group_stride + row * tables_out_stride + cols, ids, mask=cols < num_cols)


def build_step_inputs(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32/int64 (a longer buffer is fine)
    num_computed_tokens: torch.Tensor,  # [num_reqs] int32/int64, per batch row, tokens already in the KV cache
    token_ids: torch.Tensor,  # [max_slots, max_model_len] int64, per-slot token history
    input_ids_out: torch.Tensor,  # [max_num_tokens] int64, written in [0, num_tokens_padded)
    positions_out: torch.Tensor,  # [max_num_tokens] int64, written in [0, num_tokens_padded)
    num_tokens_padded: int,
    block_tables: torch.Tensor,  # [groups, max_slots, max_blocks] int32, slot-indexed persistent tables
    block_size: int,
    slot_mapping_out: torch.Tensor,  # [groups, max_num_tokens] int64, written in [0, num_tokens_padded)
    block_tables_out: torch.Tensor,  # [groups, max_num_reqs, max_blocks] int32, rows [0, num_reqs_padded) written
    num_reqs_padded: int,
    max_num_blocks_needed: int | None = None,
    rejected_by_slot: torch.Tensor | None = None,  # [max_slots] int32/int64, drafts each slot's last step rejected
    seq_lens: torch.Tensor | None = None,  # [num_reqs] int32/int64, with rejected_by_slot
    num_back_rows: int = 0,  # rows (the first ones) that rejected_by_slot applies to
) -> None:
    """A step's token inputs and KV-cache addresses, in one launch:

    - query token i of row r: position num_computed[r] + i, input id token_ids[slot, position];
      tokens in [num_tokens, num_tokens_padded) (CUDA-graph padding) get position 0 and id 0, so
      a padded forward reads valid memory; entries past num_tokens_padded are untouched;
    - its flat KV-cache slot in each group g: block_tables[g, slot, pos // bs] * bs + pos % bs;
      padding tokens get -1: the attention write must skip them, or it would clobber block 0;
    - block_tables_out[g, r] = block_tables[g, idx_mapping[r]]; padded rows are zero (block 0,
      never read). With `max_num_blocks_needed` (a host bound, e.g. cdiv(max_seq_len, block_size))
      only the first that many columns are written; later ones keep stale ids nothing reads.

    An overlapped step after a verifying one whose output the host has not seen (it counted
    every draft accepted): rows r < num_back_rows first move back by the drafts their slot's
    last step rejected, num_computed_tokens[r] and seq_lens[r] decreasing by
    rejected_by_slot[idx_mapping[r]] in place -- in this launch, not in four more.
    """
    num_reqs = idx_mapping.shape[0]
    _check_1d(idx_mapping, "idx_mapping", num_reqs)
    _check_1d(query_start_loc, "query_start_loc", num_reqs + 1)
    _check_1d(num_computed_tokens, "num_computed_tokens", num_reqs)
    _check_2d(token_ids, "token_ids", (torch.int64,))
    _check_1d(input_ids_out, "input_ids_out", num_tokens_padded, (torch.int64,))
    _check_1d(positions_out, "positions_out", num_tokens_padded, (torch.int64,))
    groups, _, width = block_tables.shape
    assert block_size > 0, f"block_size {block_size}"
    assert block_tables.dtype == block_tables_out.dtype == torch.int32 and block_tables.stride(-1) == block_tables_out.stride(-1) == 1, (
        f"block tables: want int32 with unit column stride; got {block_tables.dtype} {block_tables.stride()} -> "
        f"{block_tables_out.dtype} {block_tables_out.stride()}"
    )
    assert slot_mapping_out.dtype == torch.int64 and slot_mapping_out.stride(-1) == 1, (
        f"slot_mapping_out: want int64 with unit stride, got {slot_mapping_out.dtype} {slot_mapping_out.stride()}"
    )
    cols = width if max_num_blocks_needed is None else max_num_blocks_needed
    assert num_reqs <= num_reqs_padded, f"num_reqs_padded {num_reqs_padded} < num_reqs {num_reqs}"
    assert (
        slot_mapping_out.shape[0] == block_tables_out.shape[0] == groups
        and slot_mapping_out.shape[1] >= num_tokens_padded
        and block_tables_out.shape[1] >= num_reqs_padded
        and 0 <= cols <= min(width, block_tables_out.shape[2])
    ), (
        f"{groups} groups' tables {tuple(block_tables.shape)}: outputs {tuple(slot_mapping_out.shape)} and "
        f"{tuple(block_tables_out.shape)} cannot hold {num_tokens_padded} tokens, {num_reqs_padded} rows x {cols} columns"
    )
    assert 0 <= num_back_rows <= num_reqs, f"num_back_rows {num_back_rows} outside [0, {num_reqs}]"
    if num_back_rows:
        assert rejected_by_slot is not None and seq_lens is not None, "num_back_rows needs rejected_by_slot and seq_lens"
        _check_1d(rejected_by_slot, "rejected_by_slot", 0)
        _check_1d(seq_lens, "seq_lens", num_back_rows)
    if not use_triton(input_ids_out.device):
        build_step_inputs_ref(
            idx_mapping, query_start_loc, num_computed_tokens, token_ids, input_ids_out, positions_out, num_tokens_padded,
            block_tables, block_size, slot_mapping_out, block_tables_out, num_reqs_padded, max_num_blocks_needed,
            rejected_by_slot, seq_lens, num_back_rows,
        )  # fmt: skip
        return
    has_back = num_back_rows > 0
    _build_step_inputs_kernel[(max(num_reqs + 1, num_reqs_padded),)](
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        token_ids,
        token_ids.stride(0),
        input_ids_out,
        positions_out,
        block_tables,
        block_tables.stride(0),
        block_tables.stride(1),
        slot_mapping_out,
        slot_mapping_out.stride(0),
        block_tables_out,
        block_tables_out.stride(0),
        block_tables_out.stride(1),
        num_reqs,
        num_tokens_padded,
        num_reqs_padded,
        cols,
        rejected_by_slot if has_back else idx_mapping,
        seq_lens if has_back else idx_mapping,
        num_back_rows,
        NUM_GROUPS=groups,
        KV_BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
        HAS_BACK=has_back,
    )
