"""Slots are stable, reused after a request leaves, and never shared.

Guards against: a slot handed to two live requests, a freed slot whose stale length leaks into
the next request, a preempted request re-admitted without its earlier output.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.core_runner.runner.scheduler_output import NewRequestData
from slotrunner.core_runner.runner.request_state import RequestState
from slotrunner.sampling_params import SamplingParams


def new_req(req_id: str, tokens: list[int], prompt_len: int | None = None) -> NewRequestData:
    return NewRequestData(req_id, prompt_len or len(tokens), tokens, [0], 0, SamplingParams(), 0)


def test_slot_reuse_after_finish():
    state = RequestState(max_num_reqs=3, max_model_len=16, device=torch.device("cpu"))
    a, b, c = (state.add(new_req(x, [1, 2, 3])) for x in "abc")
    assert sorted([a, b, c]) == [0, 1, 2]
    assert state.remove("b") == b
    assert state.remove("b") is None  # second removal is a no-op
    d = state.add(new_req("d", [9, 8]))
    assert d == b, "the freed slot is reused"
    assert state.token_ids[d, :2].tolist() == [9, 8]
    assert state.num_tokens_np[d] == 2 and state.prefill_len_np[d] == 2
    assert state.req_id_to_slot["d"] == d and state.req_id_to_slot["a"] == a


def test_resumed_request_keeps_prefill_len_above_prompt_len():
    state = RequestState(max_num_reqs=1, max_model_len=16, device=torch.device("cpu"))
    slot = state.add(new_req("r", [1, 2, 3, 40, 41], prompt_len=3))
    assert state.prompt_len_np[slot] == 3 and state.prefill_len_np[slot] == 5


def test_no_free_slot_is_an_invariant_error():
    state = RequestState(max_num_reqs=1, max_model_len=16, device=torch.device("cpu"))
    state.add(new_req("a", [1]))
    with pytest.raises(AssertionError, match="no free slot"):
        state.add(new_req("b", [1]))
