"""Depthwise causal conv1d with a per-slot state: varlen prefill and single-token decode update.

Each channel d of a row's token stream is convolved with its own `kernel_size` taps:

    out[t, d] = act(bias[d] + sum_k weight[d, k] * u[t - (K - 1) + k, d])

where positions before the row's first token of this step come from its conv state
`conv_state[slot]` ([dim, K - 1], oldest first) -- or are zero for a row without initial state
(the first chunk of a prompt). Afterwards the state holds the row's last K - 1 inputs, so the
next step (decode token or next prefill chunk) continues exactly where this one stopped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

ACTIVATIONS = (None, "silu", "swish")


if HAS_TRITON:

    @triton.jit
    def _causal_conv1d_varlen_kernel(
        x_ptr,  # [num_tokens, dim], token stride stride_x
        w_ptr,  # [dim, K] contiguous
        bias_ptr,  # [dim]
        state_ptr,  # [num_slots, dim, K - 1] contiguous
        out_ptr,  # [num_tokens, dim] contiguous
        query_start_loc_ptr,  # [num_reqs + 1]
        state_indices_ptr,  # [num_reqs]
        has_initial_state_ptr,  # [num_reqs] bool
        stride_x,
        dim,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # One program per (row, channel block). It reads the row's old state for the first K - 1
        # outputs and then overwrites it: no other program touches this slice of the state.
        row = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        mask_d = offs_d < dim
        start = tl.load(query_start_loc_ptr + row).to(tl.int64)
        end = tl.load(query_start_loc_ptr + row + 1).to(tl.int64)
        slot = tl.load(state_indices_ptr + row).to(tl.int64)
        has_init = tl.load(has_initial_state_ptr + row).to(tl.int32) != 0
        state_row = state_ptr + slot * dim * (K - 1) + offs_d[:, None] * (K - 1)

        w = tl.load(w_ptr + offs_d[:, None] * K + offs_k[None, :], mask=mask_d[:, None] & (offs_k[None, :] < K), other=0.0)
        w = w.to(tl.float32)
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

        for t in range(start, end):
            src = t - (K - 1) + offs_k  # token index of each tap
            from_x = (offs_k < K) & (src >= start)
            from_state = (offs_k < K) & (src < start)
            x_ptrs = x_ptr + tl.maximum(src, 0)[None, :] * stride_x + offs_d[:, None]
            xv = tl.load(x_ptrs, mask=mask_d[:, None] & from_x[None, :], other=0.0)
            col = tl.maximum(src - start + (K - 1), 0)  # state column of a tap before the row's first token
            sv = tl.load(state_row + col[None, :], mask=mask_d[:, None] & from_state[None, :], other=0.0)
            sv = tl.where(has_init, sv, 0.0)  # not in the mask: the interpreter rejects a scalar mask there
            acc = tl.sum((xv.to(tl.float32) + sv.to(tl.float32)) * w, axis=1) + bias
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + t * dim + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)

        # New state: the last K - 1 inputs of [old state | this step's tokens].
        src = end - (K - 1) + offs_k
        keep = offs_k < K - 1
        x_ptrs = x_ptr + tl.maximum(src, 0)[None, :] * stride_x + offs_d[:, None]
        xv = tl.load(x_ptrs, mask=mask_d[:, None] & (keep & (src >= start))[None, :], other=0.0)
        col = tl.maximum(src - start + (K - 1), 0)
        sv = tl.load(state_row + col[None, :], mask=mask_d[:, None] & (keep & (src < start))[None, :], other=0.0)
        sv = tl.where(has_init, sv, 0.0)
        new_state = xv.to(tl.float32) + sv.to(tl.float32)
        tl.store(state_row + offs_k[None, :], new_state.to(state_ptr.dtype.element_ty), mask=mask_d[:, None] & keep[None, :])


    @triton.jit
    def _causal_conv1d_update_kernel(
        x_ptr,  # [num_reqs, dim], row stride stride_x
        w_ptr,  # [dim, K] contiguous
        bias_ptr,  # [dim]
        state_ptr,  # [num_slots, dim, K - 1] contiguous
        out_ptr,  # [num_reqs, dim] contiguous
        state_indices_ptr,  # [num_reqs]
        stride_x,
        dim,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        mask_d = offs_d < dim
        slot = tl.load(state_indices_ptr + row).to(tl.int64)
        state_row = state_ptr + slot * dim * (K - 1) + offs_d[:, None] * (K - 1)

        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        # Window [state | x]: tap k < K - 1 is state column k, tap K - 1 is this token.
        old = tl.load(state_row + offs_k[None, :], mask=mask_d[:, None] & (offs_k < K - 1)[None, :], other=0.0)
        window = tl.where((offs_k == K - 1)[None, :], x[:, None], old.to(tl.float32))
        w = tl.load(w_ptr + offs_d[:, None] * K + offs_k[None, :], mask=mask_d[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = tl.sum(window * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * dim + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)

        # Shift left by one: column j takes tap j + 1 (both loads happen before this store).
        nxt_mask = mask_d[:, None] & (offs_k + 1 < K - 1)[None, :]
        nxt = tl.load(state_row + (offs_k + 1)[None, :], mask=nxt_mask, other=0.0)
        new_state = tl.where((offs_k + 1 == K - 1)[None, :], x[:, None], nxt.to(tl.float32))
        state_mask = mask_d[:, None] & (offs_k < K - 1)[None, :]
        tl.store(state_row + offs_k[None, :], new_state.to(state_ptr.dtype.element_ty), mask=state_mask)


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, activation: str | None
) -> None:
    dim, k = weight.shape
    assert x.dim() == 2 and x.shape[1] == dim, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}"
    assert k >= 2, f"kernel_size must be >= 2, got {k}"
    assert conv_state.shape[1:] == (dim, k - 1), f"conv_state {tuple(conv_state.shape)} is not [num_slots, {dim}, {k - 1}]"
    assert bias is None or bias.shape == (dim,)
    assert activation in ACTIVATIONS, f"activation {activation!r} not in {ACTIVATIONS}"


def _launch_args(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> dict[str, int]:
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    k = weight.shape[1]
    return dict(K=k, BLOCK_D=min(128, triton.next_power_of_2(weight.shape[0])), BLOCK_K=triton.next_power_of_2(k))


def causal_conv1d_varlen(
    x: torch.Tensor,  # [num_tokens, dim], rows' tokens back to back
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    conv_state: torch.Tensor,  # [num_slots, dim, kernel_size - 1], updated in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    has_initial_state: torch.Tensor,  # [num_reqs] bool: start from conv_state (else from zeros)
    activation: str | None = "silu",
) -> torch.Tensor:  # [num_tokens, dim], dtype of x
    """Prefill: convolve each row's tokens, continuing from its state; leave its last K-1 inputs
    in the state. Rows may be empty (the state is then kept, or zeroed without initial state)."""
    _check(x, weight, bias, conv_state, activation)
    num_reqs = state_indices.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and has_initial_state.shape == (num_reqs,)
    if not use_triton(x.device):
        return causal_conv1d_varlen_ref(
            x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, activation
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return out
    args = _launch_args(x, weight, conv_state)
    grid = (num_reqs, triton.cdiv(x.shape[1], args["BLOCK_D"]))
    _causal_conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc, state_indices,
        has_initial_state, x.stride(0), x.shape[1], HAS_BIAS=bias is not None, SILU=activation is not None, **args,
    )  # fmt: skip
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [num_reqs, dim], one token per row
    weight: torch.Tensor,  # [dim, kernel_size]
    bias: torch.Tensor | None,  # [dim]
    conv_state: torch.Tensor,  # [num_slots, dim, kernel_size - 1], updated in place
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    activation: str | None = "silu",
) -> torch.Tensor:  # [num_reqs, dim]
    """Decode: one token per row against its state (always read: a new slot's state is zero)."""
    _check(x, weight, bias, conv_state, activation)
    assert state_indices.shape == (x.shape[0],)
    if not use_triton(x.device):
        return causal_conv1d_update_ref(x, weight, bias, conv_state, state_indices, activation)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    args = _launch_args(x, weight, conv_state)
    grid = (x.shape[0], triton.cdiv(x.shape[1], args["BLOCK_D"]))
    _causal_conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out, state_indices, x.stride(0), x.shape[1],
        HAS_BIAS=bias is not None, SILU=activation is not None, **args,
    )  # fmt: skip
    return out


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The specification: per row, prepend the state (or zeros) and run a valid depthwise conv."""
    dim, k = weight.shape
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    for row, (slot, has_init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[row], bounds[row + 1]
        init = conv_state[slot].float() if has_init else x.new_zeros(dim, k - 1, dtype=torch.float32)
        full = torch.cat([init, x[start:end].float().T], dim=1)  # [dim, K - 1 + len]
        if end > start:
            y = F.conv1d(full[None], weight.float()[:, None], None if bias is None else bias.float(), groups=dim)[0]
            out[start:end] = _act(y, activation).T.to(x.dtype)
        conv_state[slot] = full[:, full.shape[1] - (k - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The specification: window = [state | token], dot with the taps, shift the state by one."""
    window = torch.cat([conv_state[state_indices].float(), x.float()[:, :, None]], dim=2)  # [num_reqs, dim, K]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state[state_indices] = window[:, :, 1:].to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)
