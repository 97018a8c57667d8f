"""Mamba2 SSD chunked scan for prefill, varlen: every row's tokens, from its slot's state.

The scan computes the same recurrence as `selective_state_update` token after token, but one
chunk of L tokens at a time, with matrix products (the "state space duality"). In a chunk, with
the cumulative log-decay cs[l] = sum_{i<=l} dt[i] * A and s0 the state entering the chunk:

    y[l]   = sum_{s<=l} exp(cs[l] - cs[s]) * (C[l] . B[s]) * dt[s] * x[s]     (intra-chunk)
           + exp(cs[l]) * s0 @ C[l]                                          (from the state)
           + D * x[l]
    s_out  = exp(cs[L-1]) * s0 + sum_s exp(cs[L-1] - cs[s]) * dt[s] * x[s] (x) B[s]

The chunk length changes only rounding, not the result: the reference uses the model's
`chunk_size` (as transformers does), the Triton kernel whatever tile suits the GPU.
Each row starts from `ssm_state[slot]` when `has_initial_state` (a later chunk of a chunked
prefill), else from zero; its final state is written back to `ssm_state[slot]`.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton
from slotrunner.models.layers.mamba.selective_state_update import discretize_dt_ref

MAX_KERNEL_CHUNK = 64  # the Triton kernel's tile: [chunk, chunk] scores stay in registers


if HAS_TRITON:

    @triton.jit
    def _ssd_chunk_scan_kernel(
        x_ptr,  # [num_tokens, num_heads, head_dim], token stride stride_x
        dt_ptr,  # [num_tokens, num_heads], token stride stride_dt
        a_ptr,  # [num_heads]
        b_ptr,  # [num_tokens, n_groups, state_size], token stride stride_b
        c_ptr,  # [num_tokens, n_groups, state_size], token stride stride_c
        d_ptr,  # [num_heads]
        dt_bias_ptr,  # [num_heads]
        y_ptr,  # [num_tokens, num_heads, head_dim] contiguous
        state_ptr,  # [num_slots, num_heads, head_dim, state_size] contiguous
        query_start_loc_ptr,  # [num_reqs + 1]
        state_indices_ptr,  # [num_reqs]
        has_initial_state_ptr,  # [num_reqs] bool
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
        CHUNK: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # One program per (row, head, head_dim block); it walks the row's chunks in order, carrying
        # the [BLOCK_P, state_size] state in registers. head_dim rows are independent, so the block
        # split along head_dim needs no communication.
        row = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        offs_l = tl.arange(0, CHUNK)
        mask_p = offs_p < head_dim
        mask_n = offs_n < state_size
        g = h // heads_per_group
        start = tl.load(query_start_loc_ptr + row).to(tl.int64)
        end = tl.load(query_start_loc_ptr + row + 1).to(tl.int64)
        slot = tl.load(state_indices_ptr + row).to(tl.int64)
        has_init = tl.load(has_initial_state_ptr + row).to(tl.int32) != 0

        state_ptrs = state_ptr + ((slot * num_heads + h) * head_dim + offs_p[:, None]) * state_size + offs_n[None, :]
        # tl.where, not a mask: the interpreter rejects a scalar mask broadcast against a block.
        state = tl.load(state_ptrs, mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        state = tl.where(has_init, state, 0.0)
        a = tl.load(a_ptr + h).to(tl.float32)
        d = 0.0
        if HAS_D:
            d = tl.load(d_ptr + h).to(tl.float32)
        dt_bias = 0.0
        if HAS_DT_BIAS:
            dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        causal = offs_l[:, None] >= offs_l[None, :]

        for chunk_start in range(start, end, CHUNK):
            t = chunk_start + offs_l
            mask_l = t < end
            dt = tl.load(dt_ptr + t * stride_dt + h, mask=mask_l, other=0.0).to(tl.float32) + dt_bias
            if DT_SOFTPLUS:
                dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
            dt = tl.where(mask_l, dt, 0.0)  # padding tokens neither decay nor feed the state
            cs = tl.cumsum(dt * a, axis=0)  # [CHUNK]
            cs_last = tl.sum(dt * a, axis=0)

            mask_lp = mask_l[:, None] & mask_p[None, :]
            mask_ln = mask_l[:, None] & mask_n[None, :]
            x = tl.load(x_ptr + t[:, None] * stride_x + h * head_dim + offs_p[None, :], mask=mask_lp, other=0.0)
            b = tl.load(b_ptr + t[:, None] * stride_b + g * state_size + offs_n[None, :], mask=mask_ln, other=0.0)
            c = tl.load(c_ptr + t[:, None] * stride_c + g * state_size + offs_n[None, :], mask=mask_ln, other=0.0)
            x, b, c = x.to(tl.float32), b.to(tl.float32), c.to(tl.float32)

            # Intra-chunk: decay-masked (C B^T), applied to dt * x.
            scores = tl.dot(c, tl.trans(b), input_precision=DOT_PRECISION)  # [CHUNK, CHUNK]
            decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))
            y = tl.dot(scores * decay * dt[None, :], x, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_P]
            # From the state entering the chunk.
            y += tl.dot(c, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cs)[:, None]
            if HAS_D:
                y += d * x
            y_ptrs = y_ptr + (t[:, None] * num_heads + h) * head_dim + offs_p[None, :]
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_lp)

            # Carry the state over the chunk.
            w = tl.exp(cs_last - cs) * dt  # [CHUNK]
            state = state * tl.exp(cs_last) + tl.dot(tl.trans(x * w[:, None]), b, input_precision=DOT_PRECISION)

        tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_n[None, :])


def ssd_chunk_scan_varlen(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    dt: torch.Tensor,  # [num_tokens, num_heads], before bias / softplus
    A: torch.Tensor,  # [num_heads] float32, negative
    B: torch.Tensor,  # [num_tokens, n_groups, state_size]
    C: torch.Tensor,  # [num_tokens, n_groups, state_size]
    chunk_size: int,
    ssm_state: torch.Tensor,  # [num_slots, num_heads, head_dim, state_size], final states written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    has_initial_state: torch.Tensor,  # [num_reqs] bool
    D: torch.Tensor | None = None,  # [num_heads]
    dt_bias: torch.Tensor | None = None,  # [num_heads]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    dot_precision: str | None = None,  # the kernel's tl.dot precision; None: by x's dtype (below)
    num_warps: int = 4,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of x
    num_tokens, num_heads, head_dim = x.shape
    _, n_groups, state_size = B.shape
    num_reqs = state_indices.shape[0]
    assert ssm_state.shape[1:] == (num_heads, head_dim, state_size), (
        f"ssm_state {tuple(ssm_state.shape)} does not match x {tuple(x.shape)} and B {tuple(B.shape)}"
    )
    assert dt.shape == (num_tokens, num_heads) and B.shape[0] == num_tokens and C.shape == B.shape
    assert num_heads % n_groups == 0, f"num_heads={num_heads} is not a multiple of n_groups={n_groups}"
    assert query_start_loc.shape == (num_reqs + 1,) and has_initial_state.shape == (num_reqs,)
    assert chunk_size >= 1
    if not use_triton(x.device):
        return ssd_chunk_scan_varlen_ref(
            x, dt, A, B, C, chunk_size, ssm_state, query_start_loc, state_indices, has_initial_state,
            D, dt_bias, dt_softplus, dt_limit,
        )  # fmt: skip
    assert ssm_state.is_contiguous() and x.stride()[1:] == (head_dim, 1) and dt.stride(1) == 1
    assert B.stride()[1:] == (state_size, 1) and C.stride()[1:] == (state_size, 1)
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return y
    # tl.dot wants every dimension >= 16; masked padding costs nothing but registers.
    chunk = max(16, min(MAX_KERNEL_CHUNK, triton.next_power_of_2(chunk_size)))
    block_p = max(16, min(32, triton.next_power_of_2(head_dim)))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    if dot_precision is None:
        # The products in float32 for a float32 model; TF32 tensor cores (10 mantissa bits, more
        # than the 16-bit inputs hold) for a half-precision one, the state kept in float32.
        dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _ssd_chunk_scan_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, y, ssm_state,
        query_start_loc, state_indices, has_initial_state,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        num_heads, head_dim, state_size, num_heads // n_groups, float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        CHUNK=chunk, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(state_size)), DOT_PRECISION=dot_precision,
        num_warps=num_warps,
    )  # fmt: skip
    return y


def ssd_chunk_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The specification, in float32, row by row (all chunks of a row at once)."""
    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    dt = discretize_dt_ref(dt, dt_bias, dt_softplus, dt_limit)  # [num_tokens, num_heads]
    B = B.float().repeat_interleave(heads_per_group, dim=1)  # [num_tokens, num_heads, state_size]
    C = C.float().repeat_interleave(heads_per_group, dim=1)
    xf = x.float()
    y = torch.empty_like(xf)
    bounds = query_start_loc.tolist()
    for row, (slot, has_init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[row], bounds[row + 1]
        state = ssm_state[slot].float() if has_init else xf.new_zeros(ssm_state.shape[1:])  # [heads, head_dim, state]
        if end > start:
            sl = slice(start, end)
            y[sl], state = _ssd_row(xf[sl], dt[sl], A.float(), B[sl], C[sl], chunk_size, state)
        ssm_state[slot] = state.to(ssm_state.dtype)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)


def _ssd_row(
    x: torch.Tensor,  # [T, heads, head_dim]
    dt: torch.Tensor,  # [T, heads], discretised
    A: torch.Tensor,  # [heads]
    B: torch.Tensor,  # [T, heads, state]
    C: torch.Tensor,  # [T, heads, state]
    chunk_size: int,
    state: torch.Tensor,  # [heads, head_dim, state] before the row's first token
) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, heads, head_dim] without D, state after the last token
    num_tokens = x.shape[0]
    pad = -num_tokens % chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [num_chunks, chunk_size, ...]
        # Padding tokens have dt = 0: they neither decay the state nor feed it.
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(-1, chunk_size, *t.shape[1:])

    x, dt, B, C = chunks(x), chunks(dt), chunks(B), chunks(C)
    dt = dt.transpose(1, 2)  # [c, heads, L]
    dA = dt * A[:, None]
    cs = dA.cumsum(-1)  # [c, heads, L]
    # Intra-chunk: y[l] += sum_{s<=l} exp(cs[l] - cs[s]) (C[l] . B[s]) dt[s] x[s]
    scores = torch.einsum("clhn,cshn->chls", C, B) * torch.exp(_segsum(dA)) * dt[:, :, None, :]
    y = torch.einsum("chls,cshp->clhp", scores, x)
    # Each chunk's own contribution to the state at its end, and its total decay.
    to_end = torch.exp(cs[..., -1:] - cs) * dt  # [c, heads, L]
    contrib = torch.einsum("chl,clhp,clhn->chpn", to_end, x, B)
    chunk_decay = torch.exp(cs[..., -1])[..., None, None]  # [c, heads, 1, 1]
    entering = []  # the state entering each chunk: the inter-chunk recurrence
    for c in range(x.shape[0]):
        entering.append(state)
        state = state * chunk_decay[c] + contrib[c]
    y = y + torch.einsum("clhn,chpn->clhp", C, torch.stack(entering)) * torch.exp(cs).transpose(1, 2)[..., None]
    return y.reshape(-1, *y.shape[2:])[:num_tokens], state


def _segsum(a: torch.Tensor) -> torch.Tensor:  # [..., L] -> [..., L, L]
    """out[..., l, s] = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal: summed directly
    rather than as a difference of cumulative sums, which loses precision on long chunks."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)  # x[..., l, s] = a[l]
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), -1), 0.0)
    out = x.cumsum(-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device)), float("-inf"))
