"""Mamba2 single-step recurrence (decode): advance each row's SSM state by one token, in place.

For one token of head h (group g = h // (num_heads / n_groups)), with dt already discretised:

    state <- exp(dt * A[h]) * state + dt * x[:, None] * B[g][None, :]    # [head_dim, state_size]
    y     <- state @ C[g] + D[h] * x                                      # [head_dim]

The state lives in a per-slot pool; each row reads and writes `ssm_state[state_indices[row]]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

def discretize_dt_ref(
    dt: torch.Tensor,  # [..., num_heads]
    dt_bias: torch.Tensor | None,  # [num_heads]
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:  # [..., num_heads] float32
    """dt as the scan uses it: (+ bias), softplus, clamped to `dt_limit`. The clamp applies to the
    decode step as well as the chunked scan, so both compute the same recurrence."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


if HAS_TRITON:

    @triton.jit
    def _selective_state_update_kernel(
        state_ptr,  # [num_slots, num_heads, head_dim, state_size]
        x_ptr,  # [num_reqs, num_heads, head_dim], row stride stride_x
        dt_ptr,  # [num_reqs, num_heads], row stride stride_dt
        a_ptr,  # [num_heads]
        b_ptr,  # [num_reqs, n_groups, state_size], row stride stride_b
        c_ptr,  # [num_reqs, n_groups, state_size], row stride stride_c
        d_ptr,  # [num_heads]
        dt_bias_ptr,  # [num_heads]
        y_ptr,  # [num_reqs, num_heads, head_dim], contiguous
        state_indices_ptr,  # [num_reqs]
        stride_x,
        stride_dt,
        stride_b,
        stride_c,
        num_heads,
        head_dim,
        state_size,
        heads_per_group,
        dt_min,
        dt_max,
        HAS_D: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr,
        DT_SOFTPLUS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_p = offs_p < head_dim
        mask_n = offs_n < state_size
        mask_pn = mask_p[:, None] & mask_n[None, :]
        g = h // heads_per_group
        slot = tl.load(state_indices_ptr + row).to(tl.int64)

        state_ptrs = state_ptr + ((slot * num_heads + h) * head_dim + offs_p[:, None]) * state_size + offs_n[None, :]
        state = tl.load(state_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + h * head_dim + offs_p, mask=mask_p, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + g * state_size + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + row * stride_c + g * state_size + offs_n, mask=mask_n, other=0.0).to(tl.float32)

        dt = tl.load(dt_ptr + row * stride_dt + h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + h).to(tl.float32)
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # F.softplus's threshold
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        a = tl.load(a_ptr + h).to(tl.float32)

        state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1)
        if HAS_D:
            y += tl.load(d_ptr + h).to(tl.float32) * x
        tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_pn)
        tl.store(y_ptr + (row * num_heads + h) * head_dim + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update(
    ssm_state: torch.Tensor,  # [num_slots, num_heads, head_dim, state_size], updated in place
    x: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    dt: torch.Tensor,  # [num_reqs, num_heads], before bias / softplus
    A: torch.Tensor,  # [num_heads] float32, negative
    B: torch.Tensor,  # [num_reqs, n_groups, state_size]
    C: torch.Tensor,  # [num_reqs, n_groups, state_size]
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    D: torch.Tensor | None = None,  # [num_heads]
    dt_bias: torch.Tensor | None = None,  # [num_heads]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim], dtype of x
    """One recurrence step per row; `ssm_state[state_indices]` advances in place."""
    num_reqs, num_heads, head_dim = x.shape
    _, n_groups, state_size = B.shape
    assert ssm_state.shape[1:] == (num_heads, head_dim, state_size), (
        f"ssm_state {tuple(ssm_state.shape)} does not match x {tuple(x.shape)} and B {tuple(B.shape)}"
    )
    assert dt.shape == (num_reqs, num_heads) and C.shape == B.shape and B.shape[0] == num_reqs
    assert num_heads % n_groups == 0, f"num_heads={num_heads} is not a multiple of n_groups={n_groups}"
    assert state_indices.shape == (num_reqs,)
    if not use_triton(x.device):
        return selective_state_update_ref(ssm_state, x, dt, A, B, C, state_indices, D, dt_bias, dt_softplus, dt_limit)
    assert ssm_state.is_contiguous() and x.stride()[1:] == (head_dim, 1) and dt.stride(1) == 1
    assert B.stride()[1:] == (state_size, 1) and C.stride()[1:] == (state_size, 1)
    y = torch.empty(num_reqs, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return y
    block_p = max(16, min(32, triton.next_power_of_2(head_dim)))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    _selective_state_update_kernel[grid](
        ssm_state, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, y, state_indices,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        num_heads, head_dim, state_size, num_heads // n_groups, float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(state_size)),
    )  # fmt: skip
    return y


def selective_state_update_ref(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The specification, in float32, all rows at once."""
    heads_per_group = x.shape[1] // B.shape[1]
    dt = discretize_dt_ref(dt, dt_bias, dt_softplus, dt_limit)  # [num_reqs, num_heads]
    B = B.float().repeat_interleave(heads_per_group, dim=1)  # [num_reqs, num_heads, state_size]
    C = C.float().repeat_interleave(heads_per_group, dim=1)
    xf = x.float()
    state = ssm_state[state_indices].float()  # [num_reqs, num_heads, head_dim, state_size]
    state = state * torch.exp(dt * A.float())[..., None, None] + (dt[..., None] * xf)[..., None] * B[:, :, None, :]
    ssm_state[state_indices] = state.to(ssm_state.dtype)
    y = torch.einsum("rhpn,rhn->rhp", state, C)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)

