"""Causal conv1d with per-slot state: varlen prefill and decode update against plain convolution.

Guards against: taps before a row's first token read from the wrong place (the state, zeros for
a row without initial state, never the previous row's tokens), the state left holding the wrong
K - 1 inputs (rows shorter than K - 1, empty rows), state written to the wrong slot, and a
decode update that shifts the window the wrong way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mamba_cases import CONV_DIM, CONV_KERNEL, LENGTHS, NUM_SLOTS, conv_inputs, varlen

from slotrunner.models.layers.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen

K = CONV_KERNEL


def plain_conv(history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise conv) of a whole [len, dim] sequence with zero left padding: the oracle."""
    y = F.conv1d(history.T[None], weight[:, None], bias, padding=K - 1, groups=CONV_DIM)[0, :, : history.shape[0]]
    return F.silu(y).T


def test_varlen_continues_from_state_and_keeps_last_inputs():
    v = varlen()
    inp = conv_inputs(sum(LENGTHS))
    state = inp["conv_state"].clone()
    out = causal_conv1d_varlen(inp["x"], inp["weight"], inp["bias"], state, v.query_start_loc, v.state_indices, v.has_initial_state)
    for (start, end), slot, has_init in zip(v.bounds, v.state_indices.tolist(), v.has_initial_state.tolist()):
        # The state is the K - 1 inputs before the row; without one they are zeros.
        before = inp["conv_state"][slot].T if has_init else torch.zeros(K - 1, CONV_DIM)
        history = torch.cat([before, inp["x"][start:end]])
        # The conv over [state | tokens] from zero padding: the state's own outputs are dropped,
        # only the taps it feeds into the row's tokens matter.
        expected = plain_conv(history, inp["weight"], inp["bias"])[K - 1 :]
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], history[-(K - 1) :].T, atol=0, rtol=0)
    untouched = sorted(set(range(NUM_SLOTS)) - set(v.state_indices.tolist()))
    assert torch.equal(state[untouched], inp["conv_state"][untouched])


@pytest.mark.parametrize("split", [1, K - 2, K - 1, K, 7])
def test_prefill_split_across_steps_equals_one_step(split):
    n = 11
    inp = conv_inputs(n, seed=1)
    x, w, b = inp["x"], inp["weight"], inp["bias"]
    state = torch.zeros(NUM_SLOTS, CONV_DIM, K - 1)
    one = varlen([n], [3], [False])
    whole = causal_conv1d_varlen(x, w, b, state.clone(), one.query_start_loc, one.state_indices, one.has_initial_state)
    first, second = varlen([split], [3], [False]), varlen([n - split], [3], [True])
    y1 = causal_conv1d_varlen(x[:split], w, b, state, first.query_start_loc, first.state_indices, first.has_initial_state)
    y2 = causal_conv1d_varlen(x[split:], w, b, state, second.query_start_loc, second.state_indices, second.has_initial_state)
    torch.testing.assert_close(torch.cat([y1, y2]), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(whole, plain_conv(x, w, b), atol=1e-5, rtol=1e-5)


def test_decode_updates_equal_varlen_over_the_same_tokens():
    """Prefill 2 tokens, then decode 5 one at a time, two rows side by side (slots 6 and 1)."""
    inp = conv_inputs(14, seed=2)
    x, w, b = inp["x"].view(7, 2, CONV_DIM), inp["weight"], inp["bias"]
    state = torch.zeros(NUM_SLOTS, CONV_DIM, K - 1)
    slots = torch.tensor([6, 1])
    pre = varlen([2, 2], [6, 1], [False, False])
    outs = [causal_conv1d_varlen(x[:2].transpose(0, 1).reshape(4, -1), w, b, state, pre.query_start_loc, pre.state_indices, pre.has_initial_state).view(2, 2, -1).transpose(0, 1)]
    for t in range(2, 7):
        outs.append(causal_conv1d_update(x[t], w, b, state, slots)[None])
    got = torch.cat(outs)  # [7, 2, dim]
    for row in range(2):
        torch.testing.assert_close(got[:, row], plain_conv(x[:, row], w, b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slots[row]], x[-(K - 1) :, row].T, atol=0, rtol=0)


def test_no_bias_no_activation():
    v = varlen(lengths=[5], slots=[0], has_init=[False])
    inp = conv_inputs(5, seed=3)
    out = causal_conv1d_varlen(inp["x"], inp["weight"], None, inp["conv_state"].clone(), v.query_start_loc, v.state_indices, v.has_initial_state, activation=None)
    expected = F.conv1d(inp["x"].T[None], inp["weight"][:, None], None, padding=K - 1, groups=CONV_DIM)[0, :, :5].T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
