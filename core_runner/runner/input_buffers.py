"""InputBuffers: the step's device inputs at fixed addresses, and their pinned host staging.

A step's inputs are written into the same persistent tensors every step (sized for the largest
batch), so a CUDA graph captured once reads each new step's values. The host's small per-step
description (idx_mapping, query_start_loc, cached and total lengths, which rows sample, logits
rows) goes through one pinned staging area and one non-blocking copy; everything else is built
on the device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from slotrunner.core_runner.runner.async_output import step_stream

_ALIGN = 16  # bytes: each staged field's start
_NP_DTYPE = {torch.int32: np.int32, torch.int64: np.int64}
# Token counts whose views stay cached: decode steps repeat a few, prefill chunks vary.
_CACHED_TOKEN_COUNTS = 64


class RowViews(NamedTuple):
    """The first `num_reqs` rows of the per-row buffers."""

    idx_mapping: torch.Tensor  # [num_reqs]
    num_computed: torch.Tensor  # [num_reqs]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]
    num_sampled: torch.Tensor  # [num_reqs]
    num_rejected: torch.Tensor  # [num_reqs]
    num_draft: torch.Tensor  # [num_reqs]
    decode_order: torch.Tensor  # [num_reqs]
    cu_num_logits: torch.Tensor  # [num_reqs + 1]
    logits_indices: torch.Tensor  # [num_reqs], the logits rows of a step without drafts
    one_logits_row_each: torch.Tensor  # [num_reqs + 1] 0..num_reqs: cu_num_logits of a step without drafts
    group_block_tables: torch.Tensor  # [groups, num_reqs, max_blocks]
    block_tables_of: tuple[torch.Tensor, ...]  # per KV-cache group, [num_reqs, max_blocks]


class TokenViews(NamedTuple):
    """The first `num_tokens` entries of the per-token buffers."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    group_slot_mapping: torch.Tensor  # [groups, num_tokens]
    slot_mapping_of: tuple[torch.Tensor, ...]  # per KV-cache group, [num_tokens]


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
        # What the host stages lives in one device area filled by one copy a step from one
        # pinned staging area of the same layout: each copy is a launch (host time), the bytes
        # are few. Each field is a typed view of both areas at a fixed offset.
        staged = {  # name -> (dtype, entries)
            "idx_mapping": (torch.int64, max_num_reqs),
            "num_computed": (torch.int64, max_num_reqs),
            "logits_indices": (torch.int64, max_num_reqs * (1 + max_draft)),
            "query_start_loc": (torch.int32, max_num_reqs + 1),
            "seq_lens": (torch.int32, max_num_reqs),
            "num_sampled": (torch.int32, max_num_reqs),
            "num_draft": (torch.int32, max_num_reqs),
            "shared_prefix_len": (torch.int32, 1),
            "decode_order": (torch.int32, max_num_reqs),
        }
        pin = device.type == "cuda"
        # Fields start 16-byte aligned: Triton specializes a pointer argument on 16-byte alignment,
        # and a kernel reading a field here in a graph replay and a gathered copy of it in an
        # eager step (MLA decode's seq_lens) compiled a variant for each -- the second inside a
        # run (two variants, ~2 s on one H100 with a cold kernel cache).
        nbytes = sum(-(-n * dtype.itemsize // _ALIGN) * _ALIGN for dtype, n in staged.values())
        self._staged = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        dev: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}  # the staging views
        offset = 0
        for name, (dtype, n) in staged.items():
            end = offset + n * dtype.itemsize
            dev[name] = self._staged[offset:end].view(dtype)
            self._np[name] = self._staging.numpy()[offset:end].view(_NP_DTYPE[dtype])
            offset += -(-n * dtype.itemsize // _ALIGN) * _ALIGN
        self.idx_mapping = dev["idx_mapping"]  # [max_num_reqs] batch row -> slot
        self.num_computed = dev["num_computed"]  # [max_num_reqs] tokens cached before the step
        # One logits row per batch row, plus one per draft (speculative decoding), rows in order.
        self.logits_indices = dev["logits_indices"]  # [max_num_reqs * (1 + max_draft)]
        self.query_start_loc = dev["query_start_loc"]  # [max_num_reqs + 1]
        self.seq_lens = dev["seq_lens"]  # [max_num_reqs] 0 on padding rows
        self.num_sampled = dev["num_sampled"]  # [max_num_reqs] 1 if the row samples
        self.num_draft = dev["num_draft"]  # [max_num_reqs] drafts scheduled per row
        self.shared_prefix_len = dev["shared_prefix_len"]  # [1] keys every row shares (decode steps; 0: none)
        # [max_num_reqs] the rows by decreasing length (AttentionMetadata.decode_order), then the padding rows
        self.decode_order = dev["decode_order"]
        self.num_rejected = torch.zeros(max_num_reqs, **i32)  # [max_num_reqs] always 0 until draft tokens exist
        # Per KV-cache group (runner/kv_cache.py); `block_tables` / `slot_mapping` are group 0's.
        # [groups, max_num_reqs, max_blocks]
        self.group_block_tables = torch.zeros(num_kv_groups, max_num_reqs, max_num_blocks_per_req, **i32)
        self.group_slot_mapping = torch.full((num_kv_groups, max_num_tokens), -1, **i64)  # [groups, max_num_tokens] -1 on padding
        self.block_tables = self.group_block_tables[0]  # [max_num_reqs, max_blocks]
        self.input_ids = torch.zeros(max_num_tokens, **i64)  # [max_num_tokens]
        self.positions = torch.zeros(max_num_tokens, **i64)  # [max_num_tokens]
        self.slot_mapping = self.group_slot_mapping[0]  # [max_num_tokens] -1 on padding tokens
        self.cu_num_logits = torch.zeros(max_num_reqs + 1, **i32)  # [max_num_reqs + 1]
        self.one_logits_row_each = torch.arange(max_num_reqs + 1, **i32)  # [max_num_reqs + 1], never written
        # The staging is rewritten next step only after this step's copy has read it. The event is
        # recorded on the stream current at construction: the steps' stream (step_stream), which
        # the runner takes from here.
        self._copied = torch.cuda.Event() if pin else None
        self.stream = step_stream(device)
        self._arange = np.arange(max_num_reqs, dtype=np.int32)
        self._np["decode_order"][:] = self._arange  # a permutation before the first step too (graph captures)
        self.decode_order.copy_(torch.from_numpy(self._arange))
        # A step's InputBatch is views of these buffers; the views of a size are made once (each
        # slice is host time, ~15 a step).
        self.rows = functools.lru_cache(maxsize=None)(self._rows)  # at most max_num_reqs + 1 sizes
        self.tokens = functools.lru_cache(maxsize=_CACHED_TOKEN_COUNTS)(self._tokens)

    @torch.inference_mode(False)  # plain views, whoever asks first: they may be written later
    def _rows(self, n: int) -> RowViews:
        return RowViews(
            self.idx_mapping[:n], self.num_computed[:n], self.query_start_loc[: n + 1], self.seq_lens[:n],
            self.num_sampled[:n], self.num_rejected[:n], self.num_draft[:n], self.decode_order[:n], self.cu_num_logits[: n + 1],
            self.logits_indices[:n], self.one_logits_row_each[: n + 1], self.group_block_tables[:, :n],
            tuple(t[:n] for t in self.group_block_tables),
        )  # fmt: skip

    @torch.inference_mode(False)
    def _tokens(self, t: int) -> TokenViews:
        return TokenViews(
            self.input_ids[:t], self.positions[:t], self.group_slot_mapping[:, :t], tuple(m[:t] for m in self.group_slot_mapping)
        )

    def stage(
        self,
        idx_mapping_np: np.ndarray,  # [num_reqs]
        num_computed_np: np.ndarray,  # [num_reqs]
        query_start_loc_np: np.ndarray,  # [num_reqs + 1]
        seq_lens_np: np.ndarray,  # [num_reqs]
        sample_mask_np: np.ndarray,  # [num_reqs] bool
        num_reqs_padded: int,
        num_draft_np: np.ndarray | None = None,  # [num_reqs] drafts per row (speculative decoding)
        shared_prefix_len: int = 0,  # keys every row reads from the same blocks (InputBatch.shared_prefix_len)
        carries_drafts: bool = False,  # some row of num_draft_np has drafts
        order_decode_rows: bool = False,  # stage decode_order (AttentionBackend.orders_decode_rows)
    ) -> None:
        """Copy the host description of the step to the device. Rows in [num_reqs,
        num_reqs_padded) are padding: slot 0, nothing cached, an empty query, seq_len 0, no
        sample. Without drafts (not `carries_drafts`), row r's logits row is its last query token;
        with drafts the device writes the logits rows (combine_sampled_and_draft_tokens).

        The whole staging area is copied: entries past a field's padded rows hold what an
        earlier step left there, as the device's did before (nothing reads them)."""
        n, R = len(idx_mapping_np), self.max_num_reqs
        assert n <= num_reqs_padded <= R, f"{n} rows padded to {num_reqs_padded} exceed max_num_reqs={R}"
        if self._copied is not None and not self._copied.query():  # normally long done: no wait
            self._copied.synchronize()
        h = self._np
        for name, rows in (("idx_mapping", idx_mapping_np), ("num_computed", num_computed_np), ("seq_lens", seq_lens_np),
                           ("num_sampled", sample_mask_np)):  # fmt: skip
            h[name][:n] = rows
            h[name][n:num_reqs_padded] = 0
        qsl = h["query_start_loc"]
        qsl[: n + 1] = query_start_loc_np
        qsl[n + 1 : num_reqs_padded + 1] = query_start_loc_np[-1]
        if not carries_drafts:
            np.subtract(query_start_loc_np[1:], 1, out=h["logits_indices"][:n])
        if num_draft_np is not None:
            h["num_draft"][:n] = num_draft_np
            h["num_draft"][n:num_reqs_padded] = 0
        h["shared_prefix_len"][0] = shared_prefix_len
        if order_decode_rows:  # longest first (stable: equal lengths keep their batch order), then the padding rows
            order = h["decode_order"]
            order[:n] = np.argsort(-seq_lens_np, kind="stable") if n > 1 else 0
            order[n:num_reqs_padded] = self._arange[n:num_reqs_padded]
        self._staged.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record(self.stream)
