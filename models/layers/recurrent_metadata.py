"""RecurrentMetadata: what recurrent layers (Mamba2 mixers, gated delta-nets) read from the
forward context in one step.

Built once per step by `RecurrentHybridModelState.prepare_attn` from the InputBatch (host-side
numpy plus non-blocking copies: no host<->device sync), shared by every recurrent layer of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from slotrunner.core_runner.runner.model_state import FamilyAttnMetadata


@dataclass(frozen=True)
class DraftStep:
    """Token j of every draft row that has one: run as a decode token, then the state it leaves
    is kept as checkpoint `checkpoint_idx` of the row's slot."""

    token_idx: torch.Tensor  # [n] int64, batch token
    state_indices: torch.Tensor  # [n] int64, slot
    checkpoint_idx: torch.Tensor  # [n] int64, position among the row's last 1 + num_draft tokens


@dataclass(frozen=True)
class RecurrentMetadata(FamilyAttnMetadata):
    """Batch rows split into decode, prefill and draft rows; rows keep the batch order.

    A *decode row* has exactly one query token: conv update + single-step recurrence advance its
    slot's state. That includes a new request whose whole prompt is one token, whose slot state
    was zeroed at admission. Every other row is a *prefill row*: varlen conv + chunked scan over
    its tokens, starting from its slot's state when it has one (`num_computed_tokens > 0`: a later
    chunk of a chunked prefill), else from zero. A *draft row* (speculative decoding: its last
    known token and num_draft drafts) runs token by token through the decode path
    (`draft_steps`), and after each of its last 1 + num_draft tokens the layer keeps its state as
    a checkpoint, so that the ModelState can restore the one after the last accepted token.
    Tokens are gathered by index, never moved; the per-slot pools are addressed through the
    state indices (= batch.idx_mapping).
    """

    num_reqs: int
    num_tokens: int
    state_indices: torch.Tensor  # [num_reqs] int64, slot of each batch row
    has_initial_state: torch.Tensor  # [num_reqs] bool, num_computed_tokens > 0
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    # decode rows
    num_decodes: int
    decode_token_idx: torch.Tensor | None  # [num_decodes] int64 token of each decode row; None: every row
    decode_state_indices: torch.Tensor  # [num_decodes] int64
    # prefill rows, their tokens gathered back to back
    num_prefills: int
    num_prefill_tokens: int
    prefill_token_idx: torch.Tensor | None  # [num_prefill_tokens] int64; None: every token, in order
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, over the gathered tokens
    prefill_state_indices: torch.Tensor  # [num_prefills] int64
    prefill_has_initial_state: torch.Tensor  # [num_prefills] bool
    # draft rows: step j runs token j of every draft row that has one
    draft_steps: tuple[DraftStep, ...] = field(default=())

    @classmethod
    def decode_only(
        cls,
        num_reqs: int,
        state_indices: torch.Tensor,  # [num_reqs] int64, a view of a persistent buffer
        query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
        has_initial_state: torch.Tensor,  # [num_reqs] bool, all True
        empty: dict[str, torch.Tensor],  # persistent empty prefill fields: "qsl" [1] int32, "slots" [0], "init" [0]
    ) -> RecurrentMetadata:
        """A batch of decode rows only, every tensor at a fixed address: what a CUDA graph of a
        decode step captures (`prepare_dummy_attn`) and what each such step rewrites in place.
        Tokens are the rows, in order (no gathers)."""
        return cls(
            num_reqs=num_reqs,
            num_tokens=num_reqs,
            state_indices=state_indices,
            has_initial_state=has_initial_state,
            query_start_loc=query_start_loc,
            num_decodes=num_reqs,
            decode_token_idx=None,
            decode_state_indices=state_indices,
            num_prefills=0,
            num_prefill_tokens=0,
            prefill_token_idx=None,
            prefill_query_start_loc=empty["qsl"],
            prefill_state_indices=empty["slots"],
            prefill_has_initial_state=empty["init"],
        )

    @classmethod
    def build(
        cls,
        idx_mapping: torch.Tensor,  # [num_reqs] slot of each batch row, on the device
        idx_mapping_np: np.ndarray,  # [num_reqs] the same, on the host
        num_computed_tokens_np: np.ndarray,  # [num_reqs]
        num_scheduled_tokens_np: np.ndarray,  # [num_reqs]
        query_start_loc: torch.Tensor,  # [num_reqs + 1] on the device
        num_draft_np: np.ndarray | None = None,  # [num_reqs] drafts per row (speculative decoding)
    ) -> RecurrentMetadata:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(idx_mapping.device, non_blocking=True)

        num_reqs = len(idx_mapping_np)
        q_lens = num_scheduled_tokens_np.astype(np.int64)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        slots = idx_mapping_np.astype(np.int64)
        has_init = num_computed_tokens_np > 0

        is_draft = np.zeros(num_reqs, dtype=bool) if num_draft_np is None else num_draft_np > 0
        if is_draft.any():
            assert (q_lens[is_draft] >= 1 + num_draft_np[is_draft]).all(), (
                "a row with drafts must schedule its last known token and every draft"
            )
        is_decode = (q_lens == 1) & ~is_draft
        decode_rows = np.flatnonzero(is_decode)
        prefill_rows = np.flatnonzero(~is_decode & ~is_draft)
        draft_rows = np.flatnonzero(is_draft)
        prefill_lens = q_lens[prefill_rows]
        prefill_qsl = np.zeros(len(prefill_rows) + 1, dtype=np.int32)
        np.cumsum(prefill_lens, out=prefill_qsl[1:])
        # Gathers only when several kinds of rows share the batch; else each path takes all tokens.
        mixed = sum(len(rows) > 0 for rows in (decode_rows, prefill_rows, draft_rows)) > 1
        draft_steps = []
        if len(draft_rows):
            # A row's tokens before its last 1 + num_draft (none in practice) keep checkpoint 0,
            # overwritten by the right state at their last one.
            skip = q_lens[draft_rows] - 1 - num_draft_np[draft_rows]
            for j in range(int(q_lens[draft_rows].max())):
                rows = draft_rows[q_lens[draft_rows] > j]
                ck = np.maximum(j - skip[q_lens[draft_rows] > j], 0)
                draft_steps.append(DraftStep(dev(qsl[rows] + j), dev(slots[rows]), dev(ck.astype(np.int64))))
        prefill_token_idx = None
        if mixed:  # gathered token j of prefill row r is batch token qsl[r] + (j - prefill_qsl[r])
            offsets = np.repeat(qsl[prefill_rows] - prefill_qsl[:-1], prefill_lens)
            prefill_token_idx = dev(offsets + np.arange(int(prefill_qsl[-1]), dtype=np.int64))
        return cls(
            num_reqs=num_reqs,
            num_tokens=int(qsl[-1]),
            state_indices=idx_mapping,
            has_initial_state=dev(has_init),
            query_start_loc=query_start_loc,
            num_decodes=len(decode_rows),
            decode_token_idx=dev(qsl[decode_rows]) if mixed else None,
            decode_state_indices=dev(slots[decode_rows]),
            num_prefills=len(prefill_rows),
            num_prefill_tokens=int(prefill_qsl[-1]),
            prefill_token_idx=prefill_token_idx,
            prefill_query_start_loc=dev(prefill_qsl),
            prefill_state_indices=dev(slots[prefill_rows]),
            prefill_has_initial_state=dev(has_init[prefill_rows]),
            draft_steps=tuple(draft_steps),
        )
