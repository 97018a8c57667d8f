"""The single-step recurrence (decode) against transformers' and against its own definition.

Guards against: the wrong slot read or written (rows out of slot order), groups mapped to the
wrong heads, dt_bias / softplus / D forgotten, and rows that disturb each other's state.
"""

from __future__ import annotations

import pytest
import torch
from mamba_cases import HEAD_DIM, N_GROUPS, NUM_HEADS, NUM_SLOTS, ssm_inputs

from slotrunner.models.layers.mamba.selective_state_update import selective_state_update

SLOTS = torch.tensor([5, 0, 8])


def test_rows_update_their_own_slots_only():
    inp = ssm_inputs(3)
    state = inp["ssm_state"].clone()
    selective_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], SLOTS, D=inp["D"], dt_bias=inp["dt_bias"])
    untouched = sorted(set(range(NUM_SLOTS)) - set(SLOTS.tolist()))
    assert torch.equal(state[untouched], inp["ssm_state"][untouched])
    assert not torch.equal(state[SLOTS], inp["ssm_state"][SLOTS])


def test_one_head_by_hand():
    """state' = exp(dt A) state + dt x B^T, y = state' C + D x for head h of row r."""
    inp = ssm_inputs(3, seed=1)
    state = inp["ssm_state"].clone()
    y = selective_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], SLOTS, D=inp["D"], dt_bias=inp["dt_bias"])
    r, h = 2, NUM_HEADS - 1
    g = h // (NUM_HEADS // N_GROUPS)
    dt = torch.nn.functional.softplus(inp["dt"][r, h] + inp["dt_bias"][h])
    s = torch.exp(dt * inp["A"][h]) * inp["ssm_state"][SLOTS[r], h] + dt * inp["x"][r, h][:, None] * inp["B"][r, g][None, :]
    torch.testing.assert_close(state[SLOTS[r], h], s)
    torch.testing.assert_close(y[r, h], s @ inp["C"][r, g] + inp["D"][h] * inp["x"][r, h])
    assert y.shape == (3, NUM_HEADS, HEAD_DIM)


def test_matches_transformers_recurrence():
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    hf_update = getattr(modeling, "mamba2_selective_state_update", None)
    if hf_update is None:
        pytest.skip("this transformers version has no standalone mamba2_selective_state_update")
    inp = ssm_inputs(3, seed=2)
    state = inp["ssm_state"].clone()
    y = selective_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], SLOTS, D=inp["D"], dt_bias=inp["dt_bias"])
    hf_state = inp["ssm_state"][SLOTS].clone()
    p, n = HEAD_DIM, inp["B"].shape[-1]
    y_hf = hf_update(
        hf_state, inp["x"], inp["dt"][..., None].expand(-1, -1, p), inp["A"][:, None, None].expand(-1, p, n),
        inp["B"], inp["C"], inp["D"][:, None].expand(-1, p), dt_bias=inp["dt_bias"][:, None].expand(-1, p), dt_softplus=True,
    )
    torch.testing.assert_close(y, y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[SLOTS], hf_state, atol=1e-5, rtol=1e-5)


def test_no_rows():
    inp = ssm_inputs(0)
    state = inp["ssm_state"].clone()
    y = selective_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, NUM_HEADS, HEAD_DIM) and torch.equal(state, inp["ssm_state"])
