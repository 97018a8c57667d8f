"""The gated delta rule: references equal transformers' torch fallback, kernels equal references.

Guards against: a reference that drifts from `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` (the oracle's spec: L2-normalised q/k, the k_head_dim ** -0.5
scale, grouped value heads repeat_interleaved, decay applied before the delta update); a prefill
split anywhere (inside a chunk, on a chunk boundary, one token at a time) that does not continue
from the state the previous piece left; and Triton kernels that differ from their references on
awkward sizes -- rows of 1, CHUNK - 1, CHUNK, CHUNK + 1 and 2 * CHUNK + 3 tokens, empty rows,
rows out of slot order, rows without initial state over a dirty slot, head dims that are not
powers of two, several value heads per key head, strided q/k/v views of one conv output, bf16
inputs with a float32 state.
"""

from __future__ import annotations

import pytest
import torch

OUT_TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(lengths, num_k_heads=2, num_v_heads=4, head_k=16, head_v=8, num_slots=6, seed=0, device="cpu"):
    """q/k/v as strided views of one [num_tokens, conv_dim] buffer, as the layer's split gives them."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    key_dim, value_dim = num_k_heads * head_k, num_v_heads * head_v
    mixed = torch.randn(num_tokens, 2 * key_dim + value_dim, generator=gen)
    q, k, v = mixed.to(device).split([key_dim, key_dim, value_dim], dim=-1)
    q, k = q.view(num_tokens, num_k_heads, head_k), k.view(num_tokens, num_k_heads, head_k)
    v = v.view(num_tokens, num_v_heads, head_v)
    g = (-torch.rand(num_tokens, num_v_heads, generator=gen) * 1.5).to(device)
    beta = torch.rand(num_tokens, num_v_heads, generator=gen).to(device)
    state = torch.randn(num_slots, num_v_heads, head_k, head_v, generator=gen).to(device)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, g, beta, state, qsl


def test_references_equal_transformers_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from slotrunner.models.layers.gated_delta_net.chunk import chunk_gated_delta_rule_ref
    from slotrunner.models.layers.gated_delta_net.recurrent import recurrent_gated_delta_rule_ref

    q, k, v, g, beta, state, _ = _inputs([70])
    init = state[3:4].clone()
    # Value heads share key heads by repeat_interleave; transformers up to 5.17 expects that done
    # before the call, later versions do it inside (and accept it done).
    ratio = v.shape[1] // q.shape[1]
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q.repeat_interleave(ratio, 1)[None], k.repeat_interleave(ratio, 1)[None], v[None], g[None], beta[None],
        initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    # The same 70 tokens as prefill chunks of 5, 1 and 64 tokens, then token by token for the last 9.
    pieces, got = [(0, 5), (5, 6), (6, 61)], []
    for a, b in pieces:
        got.append(chunk_gated_delta_rule_ref(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, torch.tensor([0, b - a]), torch.tensor([3]),
            torch.tensor([True]),
        ))  # fmt: skip
    for t in range(61, 70):
        s = slice(t, t + 1)
        got.append(recurrent_gated_delta_rule_ref(q[s], k[s], v[s], g[s], beta[s], state, torch.tensor([3])))
    torch.testing.assert_close(torch.cat(got), want[0], **OUT_TOL)
    torch.testing.assert_close(state[3], want_state[0], **OUT_TOL)


def test_row_without_initial_state_ignores_a_dirty_slot():
    from slotrunner.models.layers.gated_delta_net.chunk import chunk_gated_delta_rule_ref

    q, k, v, g, beta, state, qsl = _inputs([7])
    clean = torch.zeros_like(state)
    args = (torch.tensor([2]), torch.tensor([False]))
    out = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, qsl, *args)
    torch.testing.assert_close(out, chunk_gated_delta_rule_ref(q, k, v, g, beta, clean, qsl, *args), atol=0, rtol=0)
    torch.testing.assert_close(state[2], clean[2], atol=0, rtol=0)


def _check_kernels_match_references(device: str = "cpu"):
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.gated_delta_net import chunk, recurrent

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    C = chunk.CHUNK
    cases = {
        # lengths per row; slots; has_initial_state
        "awkward lengths": ([1, C - 1, C, C + 1, 2 * C + 3], [4, 0, 2, 5, 1], [True, False, True, True, False]),
        "empty rows": ([0, 3, 0], [1, 3, 5], [True, True, False]),
    }
    dims = [dict(), dict(num_k_heads=1, num_v_heads=3, head_k=12, head_v=20), dict(num_k_heads=2, num_v_heads=2, head_k=32, head_v=80)]
    for name, (lengths, slots, has_init) in cases.items():
        for d in dims:
            q, k, v, g, beta, state, qsl = _inputs(lengths, device=device, **d)
            s = torch.tensor(slots, device=device)
            h = torch.tensor(has_init, device=device)
            st_k, st_r = state.clone(), state.clone()
            got = chunk.chunk_gated_delta_rule(q, k, v, g, beta, st_k, qsl, s, h)
            want = chunk.chunk_gated_delta_rule_ref(q, k, v, g, beta, st_r, qsl, s, h)
            tag = f"chunk {name} {d}"
            torch.testing.assert_close(got, want, **OUT_TOL, msg=lambda m: f"{tag}: {m}")
            torch.testing.assert_close(st_k, st_r, **OUT_TOL, msg=lambda m: f"{tag} state: {m}")
    # bf16 q/k/v (the model dtype) with a float32 state: both upcast the same values.
    q, k, v, g, beta, state, qsl = _inputs([C + 3, 2], device=device)
    s, h = torch.tensor([1, 4], device=device), torch.tensor([True, False], device=device)
    st_k, st_r = state.clone(), state.clone()
    half = [t.bfloat16() for t in (q, k, v)]
    got = chunk.chunk_gated_delta_rule(*half, g, beta, st_k, qsl, s, h)
    want = chunk.chunk_gated_delta_rule_ref(*half, g, beta, st_r, qsl, s, h)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(st_k, st_r, **OUT_TOL)
    for d in dims:
        q, k, v, g, beta, state, _ = _inputs([1] * 4, device=device, **d)
        s = torch.tensor([3, 0, 5, 1], device=device)
        st_k, st_r = state.clone(), state.clone()
        got = recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, st_k, s)
        want = recurrent.recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_r, s)
        torch.testing.assert_close(got, want, **OUT_TOL, msg=lambda m: f"recurrent {d}: {m}")
        torch.testing.assert_close(st_k, st_r, **OUT_TOL, msg=lambda m: f"recurrent {d} state: {m}")
        # bf16 inputs with a float32 state: the output takes v's dtype.
        got = recurrent.recurrent_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, state.clone(), s)
        assert got.dtype == torch.bfloat16


def test_triton_kernels_match_references(run_interpreted):
    run_interpreted(_check_kernels_match_references)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
def test_compiled_kernels_match_references():
    _check_kernels_match_references("cuda")
