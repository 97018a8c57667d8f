"""The chunked scan (prefill) against the token-by-token recurrence and against transformers.

Guards against: a chunk boundary that drops or double-counts a token's decay (lengths chunk - 1,
chunk, chunk + 1), the initial state ignored or applied to a row that has none, final states
written to the wrong slot or not at all (empty rows, slots out of order), groups mapped to the
wrong heads, and a prefill split across steps that does not continue where it stopped.
"""

from __future__ import annotations

import pytest
import torch
from mamba_cases import CHUNK, LENGTHS, NUM_SLOTS, ssm_inputs, varlen

from slotrunner.models.layers.mamba.selective_state_update import selective_state_update_ref
from slotrunner.models.layers.mamba.ssd_chunk_scan import ssd_chunk_scan_varlen

# fp32: the chunked form reassociates sums of exp-decayed terms; CONFORMANCE.md saw ~2e-6.
ATOL = RTOL = 1e-5


def scan(inp: dict, v, chunk: int = CHUNK, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    state = inp["ssm_state"].clone()
    y = ssd_chunk_scan_varlen(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, state, v.query_start_loc, v.state_indices,
        v.has_initial_state, D=inp["D"], dt_bias=inp["dt_bias"], **kw,
    )
    return y, state


def recurrence(inp: dict, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """One selective_state_update per token: the definition the chunked form must reproduce."""
    state = inp["ssm_state"].clone()
    y = torch.zeros_like(inp["x"])
    for (start, end), slot, has_init in zip(v.bounds, v.state_indices.tolist(), v.has_initial_state.tolist()):
        if not has_init:
            state[slot] = 0
        for t in range(start, end):
            sl = slice(t, t + 1)
            y[sl] = selective_state_update_ref(
                state, inp["x"][sl], inp["dt"][sl], inp["A"], inp["B"][sl], inp["C"][sl], torch.tensor([slot]),
                D=inp["D"], dt_bias=inp["dt_bias"], **kw,
            )
    return y, state


def test_chunked_scan_equals_token_by_token_recurrence():
    v = varlen()
    inp = ssm_inputs(sum(LENGTHS))
    y, state = scan(inp, v)
    y_ref, state_ref = recurrence(inp, v)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=RTOL)


def test_untouched_slots_keep_their_state():
    v = varlen()
    inp = ssm_inputs(sum(LENGTHS))
    _, state = scan(inp, v)
    untouched = sorted(set(range(NUM_SLOTS)) - set(v.state_indices.tolist()))
    assert untouched, "the case must leave some slots unused"
    assert torch.equal(state[untouched], inp["ssm_state"][untouched])


def test_empty_row_keeps_or_zeroes_its_state():
    v = varlen(lengths=[0, 0], slots=[3, 6], has_init=[True, False])
    inp = ssm_inputs(0)
    y, state = scan(inp, v)
    assert y.shape == (0, *inp["x"].shape[1:])
    assert torch.equal(state[3], inp["ssm_state"][3])
    assert not state[6].any()


@pytest.mark.parametrize("split", [1, CHUNK - 1, CHUNK, CHUNK + 1, 9])
def test_prefill_split_across_steps_equals_one_step(split):
    """Chunked prefill: the second call starts from the state the first one wrote."""
    n = 14
    inp = ssm_inputs(n, seed=1)
    whole_y, whole_state = scan(inp, varlen([n], [2], [True]))
    first = {k: (t[:split] if t.dim() and t.shape[0] == n else t) for k, t in inp.items()}
    second = {k: (t[split:] if t.dim() and t.shape[0] == n else t) for k, t in inp.items()}
    y1, state = scan(first, varlen([split], [2], [True]))
    second["ssm_state"] = state
    y2, state = scan(second, varlen([n - split], [2], [True]))
    torch.testing.assert_close(torch.cat([y1, y2]), whole_y, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, whole_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunk_size_changes_only_rounding(chunk):
    v = varlen()
    inp = ssm_inputs(sum(LENGTHS), seed=2)
    y, state = scan(inp, v, chunk)
    y_ref, state_ref = scan(inp, v, CHUNK)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=RTOL)


def test_dt_limit_clamps_like_the_recurrence():
    """time_step_limit applies to prefill and decode alike, so a chunked prefill followed by
    decode steps computes one recurrence."""
    v = varlen()
    inp = ssm_inputs(sum(LENGTHS), seed=3)
    y, state = scan(inp, v, dt_limit=(0.2, 0.5))
    y_wide, _ = scan(inp, v)
    assert not torch.allclose(y, y_wide), "the limit must bite in this case"
    y_ref, state_ref = recurrence(inp, v, dt_limit=(0.2, 0.5))
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=RTOL)


def test_matches_transformers_chunk_scan():
    """An independent oracle: transformers' pure-torch Mamba2 scan, one sequence at a time."""
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    hf_scan = getattr(modeling, "mamba2_chunk_scan", None)
    if hf_scan is None:
        pytest.skip("this transformers version has no standalone mamba2_chunk_scan")
    v = varlen(lengths=[CHUNK + 3, 2 * CHUNK], slots=[1, 5], has_init=[True, True])
    inp = ssm_inputs(3 * CHUNK + 3, seed=4)
    y, state = scan(inp, v)
    for (start, end), slot in zip(v.bounds, v.state_indices.tolist()):
        sl = slice(start, end)
        y_hf, state_hf = hf_scan(
            inp["x"][None, sl], inp["dt"][None, sl], inp["A"], inp["B"][None, sl], inp["C"][None, sl],
            chunk_size=CHUNK, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True,
            initial_states=inp["ssm_state"][slot][None], return_final_states=True,
        )
        torch.testing.assert_close(y[sl], y_hf[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[slot], state_hf[0], atol=ATOL, rtol=RTOL)


def test_bfloat16_inputs_keep_float32_state():
    v = varlen()
    inp = ssm_inputs(sum(LENGTHS), seed=5, dtype=torch.bfloat16)
    y, state = scan(inp, v)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    y32, _ = scan({k: t.float() for k, t in inp.items()}, v)
    torch.testing.assert_close(y.float(), y32, atol=0.1, rtol=0.05)
