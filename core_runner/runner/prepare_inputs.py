"""Input preparation: one step's InputBatch as a pure function of (slot tables, idx_mapping).

The host stages the step's small description (InputBuffers.stage); the input-preparation ops
(Triton on the GPU, their torch references elsewhere) build token ids, positions, lengths, block
tables and slot mapping on the device, in persistent buffers. Nothing reads the device back.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.runner import input_kernels as ik
from slotrunner.core_runner.runner import sampled_token_kernels as sk
from slotrunner.core_runner.runner.block_table import BlockTables
from slotrunner.core_runner.runner.input_batch import InputBatch
from slotrunner.core_runner.runner.input_buffers import InputBuffers
from slotrunner.core_runner.runner.request_state import RequestState


def prepare_inputs(
    req_ids: list[str],
    idx_mapping_np: np.ndarray,  # [num_reqs] slot of each batch row
    num_scheduled_tokens_np: np.ndarray,  # [num_reqs]
    state: RequestState,
    block_tables: BlockTables,
    buffers: InputBuffers | None = None,
    num_reqs_padded: int | None = None,  # >= num_reqs: CUDA-graph batch size (padding rows are empty)
    num_tokens_padded: int | None = None,  # >= num_tokens: padding tokens are never written to the cache
    shared_prefix_len: int = 0,  # keys every row reads from the same blocks (InputBatch.shared_prefix_len)
    num_draft_np: np.ndarray | None = None,  # [num_reqs] drafts per row as scheduled (speculative decoding)
    # Overlapped steps with drafts: (per-slot drafts the last step rejected, rows it applies to --
    # the first ones, cached in the runner); their start moves back by them on the device.
    rejected: tuple[torch.Tensor, int] | None = None,
    order_decode_rows: bool = False,  # stage the decode launch's row order (AttentionBackend.orders_decode_rows)
) -> InputBatch:
    num_reqs = len(req_ids)
    num_computed_np = state.num_computed_tokens_np[idx_mapping_np]
    seq_lens_np = num_computed_np + num_scheduled_tokens_np
    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens_np, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    num_reqs_padded = num_reqs if num_reqs_padded is None else num_reqs_padded
    num_tokens_padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if buffers is None:  # a one-off batch (tests): buffers of exactly this size
        buffers = InputBuffers(
            num_reqs_padded, num_tokens_padded, block_tables.max_num_blocks_per_req, state.device, state.draft_tokens.shape[1],
            block_tables.num_groups,
        )
    # A row samples when this step brings its KV cache up to every token it has: the next
    # token is then unknown. A prefill chunk that stops short samples nothing.
    sample_mask_np = seq_lens_np >= state.num_tokens_np[idx_mapping_np]
    # Speculative decoding: the tokens a decode row computes past its history are its drafts.
    speculative = state.draft_tokens.shape[1] > 0
    if speculative and num_draft_np is None:
        num_draft_np = np.maximum(seq_lens_np - state.num_tokens_np[idx_mapping_np], 0)

    carries_drafts = speculative and bool(num_draft_np.any())
    b = buffers
    # seq_lens and (without drafts) the logits rows come from the host: it knows them, and a
    # kernel launch costs more host time than their bytes in the one staging copy.
    b.stage(
        idx_mapping_np, num_computed_np, query_start_loc_np, seq_lens_np, sample_mask_np, num_reqs_padded, num_draft_np,
        shared_prefix_len, carries_drafts, order_decode_rows,
    )
    rows, tokens = b.rows(num_reqs), b.tokens(num_tokens)
    by_slot, num_back_rows = (None, 0) if rejected is None else rejected
    if by_slot is not None and by_slot.device.type == "cpu":
        # The host counted the last step's drafts as accepted (its output is not processed yet);
        # the input op moves these rows back by the rejected ones on the device. Host-side
        # lengths stay upper bounds, except on a CPU, where reading the table costs nothing and
        # the torch attention reads them.
        back_np = by_slot.numpy()[idx_mapping_np[:num_back_rows]]
        num_computed_np[:num_back_rows] -= back_np
        seq_lens_np[:num_back_rows] -= back_np
    # Token ids, positions, and each KV-cache group's slots and table rows: one launch.
    max_blocks = -(-int(seq_lens_np.max()) // block_tables.block_size) if num_reqs else 0
    ik.build_step_inputs(
        rows.idx_mapping, b.query_start_loc, rows.num_computed, state.token_ids, b.input_ids, b.positions, num_tokens_padded,
        block_tables.tables, block_tables.block_size, b.group_slot_mapping, b.group_block_tables, num_reqs_padded, max_blocks,
        by_slot, rows.seq_lens, num_back_rows,
    )  # fmt: skip
    cu_num_logits_np, cu_num_logits = None, None
    logits_indices = rows.logits_indices
    if speculative and not carries_drafts:
        # No row carries drafts: its inputs are in the token history, as without speculation
        # (the last step's tokens were written there on the device), one logits row each.
        cu_num_logits_np, cu_num_logits = np.arange(num_reqs + 1), rows.one_logits_row_each
    elif speculative:
        assert int(num_draft_np.max(initial=0)) <= state.draft_tokens.shape[1], "more drafts scheduled than proposed"
        # Decode rows' drafts into their queries; logits rows: the last 1 + num_draft tokens per row.
        sk.combine_sampled_and_draft_tokens(
            b.input_ids, rows.idx_mapping, state.last_sampled, b.query_start_loc, rows.seq_lens, state.prefill_len,
            state.draft_tokens, rows.num_draft, b.logits_indices, b.cu_num_logits,
        )
        cu_num_logits_np = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(1 + num_draft_np, out=cu_num_logits_np[1:])
        logits_indices = b.logits_indices[: int(cu_num_logits_np[-1])]
        cu_num_logits = rows.cu_num_logits
    return InputBatch(
        req_ids=req_ids,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        idx_mapping=rows.idx_mapping,
        idx_mapping_np=idx_mapping_np,
        num_scheduled_tokens_np=num_scheduled_tokens_np,
        num_computed_tokens_np=num_computed_np,
        query_start_loc=rows.query_start_loc,
        query_start_loc_np=query_start_loc_np,
        seq_lens=rows.seq_lens,
        seq_lens_np=seq_lens_np,
        input_ids=tokens.input_ids,
        positions=tokens.positions,
        logits_indices=logits_indices,
        sample_mask_np=sample_mask_np,
        num_sampled=rows.num_sampled,
        block_tables=rows.block_tables_of[0],
        slot_mapping=tokens.slot_mapping_of[0],
        group_block_tables=rows.group_block_tables,
        group_slot_mapping=tokens.group_slot_mapping,
        block_tables_of=rows.block_tables_of,
        slot_mapping_of=tokens.slot_mapping_of,
        num_reqs_padded=num_reqs_padded,
        num_tokens_padded=num_tokens_padded,
        buffers=b,
        num_draft_np=num_draft_np,
        num_draft=rows.num_draft if speculative else None,
        cu_num_logits=cu_num_logits,
        cu_num_logits_np=cu_num_logits_np,
        shared_prefix_len=shared_prefix_len,
        decode_order=rows.decode_order if order_decode_rows else None,
    )


def post_update(
    state: RequestState,
    batch: InputBatch,
    sampled: torch.Tensor,  # [num_reqs] int64, one sampled token per batch row
) -> None:
    """Append each sampling row's token to its slot's history, on device; advance lengths."""
    if batch.num_reqs == 0:
        return
    sk.post_update(
        batch.idx_mapping,
        batch.seq_lens,
        sampled.view(-1, 1),
        batch.num_sampled,
        batch.buffers.rows(batch.num_reqs).num_rejected,
        state.token_ids,
        state.last_sampled,
    )
    state.num_tokens_np[batch.idx_mapping_np[batch.sample_mask_np]] += 1
