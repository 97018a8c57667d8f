"""Input preparation: one step's InputBatch as a pure function of (slot tables, idx_mapping).

Plain torch here, on any device; nothing persistent is moved, only gathered.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.runner.block_table import BlockTables, compute_slot_mapping
from slotrunner.core_runner.runner.input_batch import InputBatch
from slotrunner.core_runner.runner.request_state import RequestState


def prepare_inputs(
    req_ids: list[str],
    idx_mapping_np: np.ndarray,  # [num_reqs] slot of each batch row
    num_scheduled_tokens_np: np.ndarray,  # [num_reqs]
    state: RequestState,
    block_tables: BlockTables,
) -> InputBatch:
    device = state.device
    num_reqs = len(req_ids)
    num_computed_np = state.num_computed_tokens_np[idx_mapping_np]
    seq_lens_np = num_computed_np + num_scheduled_tokens_np
    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens_np, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    # A row samples when this step brings its KV cache up to every token it has: the next
    # token is then unknown. A prefill chunk that stops short samples nothing.
    sample_mask_np = seq_lens_np >= state.num_tokens_np[idx_mapping_np]

    idx_mapping = torch.from_numpy(idx_mapping_np.astype(np.int64)).to(device, non_blocking=True)
    num_computed = torch.from_numpy(num_computed_np).to(device, non_blocking=True)
    query_start_loc = torch.from_numpy(query_start_loc_np).to(device, non_blocking=True)
    num_scheduled = torch.from_numpy(num_scheduled_tokens_np.astype(np.int64)).to(device, non_blocking=True)

    token_rows = torch.repeat_interleave(torch.arange(num_reqs, device=device), num_scheduled, output_size=num_tokens)
    offsets = torch.arange(num_tokens, device=device) - query_start_loc[token_rows]
    positions = num_computed[token_rows] + offsets  # [num_tokens]
    input_ids = state.token_ids[idx_mapping[token_rows], positions]  # [num_tokens]

    tables = block_tables.gather(idx_mapping)
    slot_mapping = compute_slot_mapping(tables, token_rows, positions, block_tables.block_size)
    return InputBatch(
        req_ids=req_ids,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        num_scheduled_tokens_np=num_scheduled_tokens_np,
        num_computed_tokens_np=num_computed_np,
        query_start_loc=query_start_loc.to(torch.int32),
        query_start_loc_np=query_start_loc_np,
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)).to(device, non_blocking=True),
        seq_lens_np=seq_lens_np,
        input_ids=input_ids,
        positions=positions,
        logits_indices=query_start_loc[1:] - 1,
        sample_mask_np=sample_mask_np,
        block_tables=tables,
        slot_mapping=slot_mapping,
    )


def post_update(
    state: RequestState,
    batch: InputBatch,
    sampled: torch.Tensor,  # [num_reqs] int64, one sampled token per batch row
) -> None:
    """Append each sampling row's token to its slot's history, on device; advance lengths."""
    rows_np = np.flatnonzero(batch.sample_mask_np)
    if rows_np.size == 0:
        return
    slots_np = batch.idx_mapping_np[rows_np]
    rows = torch.from_numpy(rows_np).to(state.device, non_blocking=True)
    slots = torch.from_numpy(slots_np.astype(np.int64)).to(state.device, non_blocking=True)
    cols = torch.from_numpy(batch.seq_lens_np[rows_np].astype(np.int64)).to(state.device, non_blocking=True)
    tokens = sampled.index_select(0, rows)
    state.token_ids[slots, cols] = tokens
    state.last_sampled[slots] = tokens
    state.num_tokens_np[slots_np] += 1
