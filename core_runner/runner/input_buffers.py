"""InputBuffers: the step's device inputs at fixed addresses, and their pinned host staging.

A step's inputs are written into the same persistent tensors every step (sized for the largest
batch), so a CUDA graph captured once reads each new step's values. The host's small per-step
description (idx_mapping, query_start_loc, cached lengths, which rows sample) goes through one
pinned staging buffer and two non-blocking copies; everything else is built on the device.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_num_blocks_per_req: int,
        device: torch.device,
        max_draft: int = 0,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_draft = max_draft
        self.max_num_tokens = max_num_tokens
        self.device = device
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, **i64)  # [max_num_reqs] batch row -> slot
        self.num_computed = torch.zeros(max_num_reqs, **i64)  # [max_num_reqs] tokens cached before the step
        self.query_start_loc = torch.zeros(max_num_reqs + 1, **i32)  # [max_num_reqs + 1]
        self.num_sampled = torch.zeros(max_num_reqs, **i32)  # [max_num_reqs] 1 if the row samples
        self.num_rejected = torch.zeros(max_num_reqs, **i32)  # [max_num_reqs] always 0 until draft tokens exist
        self.seq_lens = torch.zeros(max_num_reqs, **i32)  # [max_num_reqs] 0 on padding rows
        # Per KV-cache group (runner/kv_cache.py); `block_tables` / `slot_mapping` are group 0's.
        # [groups, max_num_reqs, max_blocks]
        self.group_block_tables = torch.zeros(num_kv_groups, max_num_reqs, max_num_blocks_per_req, **i32)
        self.group_slot_mapping = torch.full((num_kv_groups, max_num_tokens), -1, **i64)  # [groups, max_num_tokens] -1 on padding
        self.block_tables = self.group_block_tables[0]  # [max_num_reqs, max_blocks]
        self.input_ids = torch.zeros(max_num_tokens, **i64)  # [max_num_tokens]
        self.positions = torch.zeros(max_num_tokens, **i64)  # [max_num_tokens]
        self.slot_mapping = self.group_slot_mapping[0]  # [max_num_tokens] -1 on padding tokens
        # One logits row per batch row, plus one per draft (speculative decoding), rows in order.
        self.logits_indices = torch.zeros(max_num_reqs * (1 + max_draft), **i64)  # [max_num_reqs * (1 + max_draft)]
        self.num_draft = torch.zeros(max_num_reqs, **i32)  # [max_num_reqs] drafts scheduled per row
        self.cu_num_logits = torch.zeros(max_num_reqs + 1, **i32)  # [max_num_reqs + 1]
        self.shared_prefix_len = torch.zeros(1, **i32)  # [1] keys every row shares (decode steps; 0: none)

        pin = device.type == "cuda"
        self._stage64 = torch.zeros(2 * max_num_reqs, dtype=torch.int64, pin_memory=pin)
        self._stage32 = torch.zeros(3 * max_num_reqs + 1, dtype=torch.int32, pin_memory=pin)
        self._stage64_np = self._stage64.numpy()
        self._stage32_np = self._stage32.numpy()
        # The staging is rewritten next step only after this step's copies have read it.
        self._copied = torch.cuda.Event() if pin else None

    def stage(
        self,
        idx_mapping_np: np.ndarray,  # [num_reqs]
        num_computed_np: np.ndarray,  # [num_reqs]
        query_start_loc_np: np.ndarray,  # [num_reqs + 1]
        sample_mask_np: np.ndarray,  # [num_reqs] bool
        num_reqs_padded: int,
        num_draft_np: np.ndarray | None = None,  # [num_reqs] drafts per row (speculative decoding)
    ) -> None:
        """Copy the host description of the step to the device. Rows in [num_reqs,
        num_reqs_padded) are padding: slot 0, nothing cached, an empty query, no sample."""
        n, R = len(idx_mapping_np), self.max_num_reqs
        assert n <= num_reqs_padded <= R, f"{n} rows padded to {num_reqs_padded} exceed max_num_reqs={R}"
        if self._copied is not None and not self._copied.query():  # normally long done: no wait
            self._copied.synchronize()
        s64, s32 = self._stage64_np, self._stage32_np
        s64[:num_reqs_padded] = 0
        s64[:n] = idx_mapping_np
        s64[R : R + num_reqs_padded] = 0
        s64[R : R + n] = num_computed_np
        s32[: n + 1] = query_start_loc_np
        s32[n + 1 : num_reqs_padded + 1] = query_start_loc_np[-1]
        s32[R + 1 : R + 1 + num_reqs_padded] = 0
        s32[R + 1 : R + 1 + n] = sample_mask_np
        self.idx_mapping[:num_reqs_padded].copy_(self._stage64[:num_reqs_padded], non_blocking=True)
        self.num_computed[:num_reqs_padded].copy_(self._stage64[R : R + num_reqs_padded], non_blocking=True)
        self.query_start_loc[: num_reqs_padded + 1].copy_(self._stage32[: num_reqs_padded + 1], non_blocking=True)
        self.num_sampled[:num_reqs_padded].copy_(self._stage32[R + 1 : R + 1 + num_reqs_padded], non_blocking=True)
        if num_draft_np is not None:
            d0 = 2 * R + 1
            s32[d0 : d0 + num_reqs_padded] = 0
            s32[d0 : d0 + n] = num_draft_np
            self.num_draft[:num_reqs_padded].copy_(self._stage32[d0 : d0 + num_reqs_padded], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
