"""RecurrentMetadata: the split of a step's batch rows into decode and prefill rows.

Guards against: a row served by the wrong kernel (a 1-token row of a new request must take the
decode path, whose state was zeroed at admission; a 1-token chunk of a chunked prefill too),
prefill tokens gathered from the wrong rows when decode and prefill rows interleave, state
indices that follow batch rows instead of slots, and has_initial_state for the first chunk.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.models.layers.recurrent_metadata import RecurrentMetadata


def build(slots, computed, scheduled) -> RecurrentMetadata:
    scheduled = np.array(scheduled)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32))
    return RecurrentMetadata.build(torch.tensor(slots), np.array(slots), np.array(computed), scheduled, qsl)


def test_interleaved_rows_gather_their_own_tokens():
    # rows: decode (slot 4), prefill chunk 2 (slot 0), new 1-token prompt (slot 2), new prompt of 3 (slot 7)
    m = build(slots=[4, 0, 2, 7], computed=[9, 4, 0, 0], scheduled=[1, 5, 1, 3])
    assert (m.num_decodes, m.num_prefills, m.num_prefill_tokens, m.num_tokens) == (2, 2, 8, 10)
    assert m.decode_token_idx.tolist() == [0, 6]
    assert m.decode_state_indices.tolist() == [4, 2]
    assert m.prefill_token_idx.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert m.prefill_query_start_loc.tolist() == [0, 5, 8]
    assert m.prefill_state_indices.tolist() == [0, 7]
    assert m.prefill_has_initial_state.tolist() == [True, False]
    assert m.state_indices.tolist() == [4, 0, 2, 7]
    assert m.has_initial_state.tolist() == [True, True, False, False]


def test_uniform_batches_need_no_gather():
    decode = build(slots=[3, 1], computed=[5, 7], scheduled=[1, 1])
    assert decode.num_prefills == 0 and decode.decode_token_idx is None
    prefill = build(slots=[3, 1], computed=[0, 4], scheduled=[4, 2])
    assert prefill.num_decodes == 0 and prefill.prefill_token_idx is None
    assert prefill.prefill_query_start_loc.tolist() == [0, 4, 6]


def test_draft_rows_run_token_by_token_apart_from_prefill_rows():
    """Speculative decoding: rows with drafts (last known token + drafts) are neither decode nor
    prefill rows; step j runs token j of each, checkpoint j of its slot."""
    scheduled = np.array([3, 1, 4, 2])  # draft row (2 drafts), decode, draft row (3 drafts), prefill chunk
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32))
    slots = [5, 1, 0, 3]
    m = RecurrentMetadata.build(torch.tensor(slots), np.array(slots), np.array([7, 9, 4, 2]), scheduled, qsl,
                                num_draft_np=np.array([2, 0, 3, 0]))  # fmt: skip
    assert (m.num_decodes, m.num_prefills) == (1, 1)
    assert m.decode_token_idx.tolist() == [3] and m.prefill_token_idx.tolist() == [8, 9]
    steps = [(s.token_idx.tolist(), s.state_indices.tolist(), s.checkpoint_idx.tolist()) for s in m.draft_steps]
    assert steps == [([0, 4], [5, 0], [0, 0]), ([1, 5], [5, 0], [1, 1]), ([2, 6], [5, 0], [2, 2]), ([7], [0], [3])]
