"""The gated delta rule for decode rows: one token per row against its slot's matrix state.

    S = exp(g) * S;   S = S + k (beta (v - S^T k))^T;   o = S^T q

with q, k L2-normalised and q scaled by head_k_dim ** -0.5, per value head (each q/k head
serving num_v_heads // num_k_heads consecutive value heads), as transformers'
`torch_recurrent_gated_delta_rule` computes one step. The state is updated in place.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton
from slotrunner.models.layers.gated_delta_net.chunk import l2norm

if HAS_TRITON:

    @triton.jit
    def _recurrent_gated_delta_rule_kernel(
        q_ptr,  # [num_reqs, num_k_heads, K], strides (stride_qt, stride_qh, 1)
        k_ptr,  # [num_reqs, num_k_heads, K]
        v_ptr,  # [num_reqs, num_v_heads, V]
        g_ptr,  # [num_reqs, num_v_heads] float32 contiguous
        beta_ptr,  # [num_reqs, num_v_heads] float32 contiguous
        out_ptr,  # [num_reqs, num_v_heads, V] contiguous
        state_ptr,  # [num_slots, num_v_heads, K, V] float32 contiguous
        state_indices_ptr,  # [num_reqs]
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        num_v_heads, K, V, group, scale,
        L2NORM: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // group
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mask_k = offs_k < K
        mask_v = offs_v < V
        slot = tl.load(state_indices_ptr + row).to(tl.int64)
        state_blk = state_ptr + ((slot * num_v_heads + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        mask_s = mask_k[:, None] & mask_v[None, :]
        S = tl.load(state_blk, mask=mask_s, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * stride_qt + hk * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_kt + hk * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        g = tl.load(g_ptr + row * num_v_heads + hv)
        beta = tl.load(beta_ptr + row * num_v_heads + hv)
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(out_ptr + (row * num_v_heads + hv) * V + offs_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)
        tl.store(state_blk, S.to(state_ptr.dtype.element_ty), mask=mask_s)


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [num_reqs, num_k_heads, head_k_dim], one token per row
    k: torch.Tensor,  # [num_reqs, num_k_heads, head_k_dim]
    v: torch.Tensor,  # [num_reqs, num_v_heads, head_v_dim]
    g: torch.Tensor,  # [num_reqs, num_v_heads] float32
    beta: torch.Tensor,  # [num_reqs, num_v_heads] float32
    state: torch.Tensor,  # [num_slots, num_v_heads, head_k_dim, head_v_dim] float32, updated in place
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [num_reqs, num_v_heads, head_v_dim], dtype of v
    """Decode: one step per row (a new slot's state is zero, so a 1-token prompt starts right)."""
    num_reqs, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == num_reqs and num_v_heads % num_k_heads == 0
    assert g.shape == beta.shape == (num_reqs, num_v_heads) and g.dtype == beta.dtype == torch.float32
    assert state.shape[1:] == (num_v_heads, head_k, head_v) and state.dtype == torch.float32
    assert state_indices.shape == (num_reqs,)
    if not use_triton(q.device):
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, state, state_indices, use_qk_l2norm)
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.is_contiguous() and beta.is_contiguous()
    assert state.is_contiguous()
    out = torch.empty(num_reqs, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if num_reqs == 0:
        return out
    bk = triton.next_power_of_2(head_k)
    bv = min(64, triton.next_power_of_2(head_v))
    grid = (num_reqs, num_v_heads, triton.cdiv(head_v, bv))
    _recurrent_gated_delta_rule_kernel[grid](
        q, k, v, g, beta, out, state, state_indices,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_v_heads, head_k, head_v, num_v_heads // num_k_heads, head_k**-0.5,
        L2NORM=use_qk_l2norm, BK=bk, BV=bv,
    )  # fmt: skip
    return out


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The specification: gather the rows' states, one step of the recurrence, scatter back."""
    group = v.shape[1] // q.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1) for x in (q, k))  # [num_reqs, Hv, K]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    S = state[state_indices].float() * g.exp()[..., None, None]  # [num_reqs, Hv, K, V]
    delta = (v.float() - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    state[state_indices] = S.to(state.dtype)
    return (S * q[..., None]).sum(-2).to(v.dtype)
