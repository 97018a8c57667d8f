"""InputBatch: the per-step view of the batch, built from persistent tables through idx_mapping."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.core_runner.runner.input_buffers import InputBuffers


@dataclass(frozen=True)
class InputBatch:
    """Everything one forward needs, for `num_reqs` batch rows and `num_tokens` query tokens.

    Batch row i serves the request in slot `idx_mapping[i]`; its query tokens are
    `query_start_loc[i]:query_start_loc[i + 1]`. Nothing here is persistent: the next step
    builds a new InputBatch from the same slot tables.
    """

    req_ids: list[str]  # [num_reqs]
    num_reqs: int
    num_tokens: int
    idx_mapping: torch.Tensor  # [num_reqs] int64, batch row -> slot
    idx_mapping_np: np.ndarray  # [num_reqs]
    num_scheduled_tokens_np: np.ndarray  # [num_reqs]
    num_computed_tokens_np: np.ndarray  # [num_reqs] tokens already in the KV cache before this step
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    query_start_loc_np: np.ndarray  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] int32, tokens in the KV cache after this step
    seq_lens_np: np.ndarray  # [num_reqs]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_reqs] int64, row of each request's last query token
    sample_mask_np: np.ndarray  # [num_reqs] bool, the row's prefill is complete: it samples a token
    num_sampled: torch.Tensor  # [num_reqs] int32, sample_mask_np on the device
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32 (KV-cache group 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV-cache slot of each query token (group 0)
    # The same per KV-cache group (core_runner/runner/kv_cache.py); index 0 is the two above.
    group_block_tables: torch.Tensor  # [num_groups, num_reqs, max_num_blocks_per_req] int32
    group_slot_mapping: torch.Tensor  # [num_groups, num_tokens] int64
    block_tables_of: tuple[torch.Tensor, ...]  # group_block_tables[g], per group
    slot_mapping_of: tuple[torch.Tensor, ...]  # group_slot_mapping[g], per group
    # CUDA-graph padding: the tensors above are the first num_reqs / num_tokens entries of
    # `buffers`, whose entries up to the padded sizes are valid empty rows / skipped tokens.
    num_reqs_padded: int
    num_tokens_padded: int
    buffers: InputBuffers
    # Speculative decoding (None without a speculator): drafts per row, scheduled after the
    # row's last known token; `logits_indices` then has 1 + num_draft rows per batch row, row r's
    # at [cu_num_logits_np[r], cu_num_logits_np[r + 1]).
    num_draft_np: np.ndarray | None = None  # [num_reqs]
    num_draft: torch.Tensor | None = None  # [num_reqs] int32
    cu_num_logits: torch.Tensor | None = None  # [num_reqs + 1] int32
    cu_num_logits_np: np.ndarray | None = None  # [num_reqs + 1]
    # Keys at the start of every row that all rows read from the same cache blocks (a decode-only
    # batch over one cached prompt; `buffers.shared_prefix_len` on the device), or 0.
    shared_prefix_len: int = 0
    # [num_reqs] int32 the rows by decreasing length, where the backend reads it
    # (AttentionBackend.orders_decode_rows), else None.
    decode_order: torch.Tensor | None = None

    @property
    def num_logits(self) -> int:
        return self.num_reqs if self.cu_num_logits_np is None else int(self.cu_num_logits_np[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled_tokens_np.max()) if self.num_reqs else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_np.max()) if self.num_reqs else 0

    @property
    def num_kv_groups(self) -> int:
        return self.group_block_tables.shape[0]

    def attn_metadata(self, kv_group: int = 0) -> AttentionMetadata:
        """The common attention metadata of this step (what every backend reads), for the
        layers of one KV-cache group."""
        return AttentionMetadata(
            num_reqs=self.num_reqs,
            num_tokens=self.num_tokens,
            query_start_loc=self.query_start_loc,
            query_start_loc_np=self.query_start_loc_np,
            seq_lens=self.seq_lens,
            seq_lens_np=self.seq_lens_np,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            block_tables=self.block_tables_of[kv_group],
            slot_mapping=self.slot_mapping_of[kv_group],
            shared_prefix_len=self.buffers.shared_prefix_len if self.shared_prefix_len else None,
            decode_order=self.decode_order,
        )
