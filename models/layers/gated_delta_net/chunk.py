"""The gated delta rule over prefill rows, chunk by chunk, continuing from each row's state.

Per value head, with the row's matrix state S [k_head_dim, v_head_dim] (starting from its slot's
state, or zero for a row without initial state) and per token t (q, k L2-normalised, q scaled by
k_head_dim ** -0.5; g <= 0 the log decay, beta in (0, 1)):

    S = exp(g_t) * S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

A chunk of BT tokens is done with matmuls (the UT transform, as transformers' torch fallback
`torch_chunk_gated_delta_rule` and the FLA kernels compute it): with G the in-chunk cumulative
log decay, L = I + strict_lower((beta k) k^T * exp(G_i - G_j)), u = L^-1 (beta v),
w = L^-1 (beta k exp(G)); then v' = u - w S, o = (q exp(G)) S + lower(q k^T exp(G_i - G_j)) v',
S = exp(G_last) S + (k exp(G_last - G))^T v'. Chunks start at each row's first token, so any
split of a prompt into prefill chunks gives the same result up to rounding. q/k heads serve
num_v_heads // num_k_heads consecutive value heads each (grouped value attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

CHUNK = 16  # tokens per chunk in the kernel: tl.dot's smallest tile; the reference uses transformers' 64
REF_CHUNK = 64
L2NORM_EPS = 1e-6


if HAS_TRITON:

    @triton.jit
    def _chunk_gated_delta_rule_kernel(
        q_ptr,  # [num_tokens, num_k_heads, K], strides (stride_qt, stride_qh, 1)
        k_ptr,  # [num_tokens, num_k_heads, K], strides (stride_kt, stride_kh, 1)
        v_ptr,  # [num_tokens, num_v_heads, V], strides (stride_vt, stride_vh, 1)
        g_ptr,  # [num_tokens, num_v_heads] float32 contiguous
        beta_ptr,  # [num_tokens, num_v_heads] float32 contiguous
        out_ptr,  # [num_tokens, num_v_heads, V] contiguous
        state_ptr,  # [num_slots, num_v_heads, K, V] float32 contiguous
        query_start_loc_ptr,  # [num_reqs + 1]
        state_indices_ptr,  # [num_reqs]
        has_initial_state_ptr,  # [num_reqs] bool
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        num_v_heads, K, V, group, scale,
        L2NORM: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, value head, block of value columns): the columns of S evolve
        # independently, so the program owns its slice of the row's state from load to store.
        row = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // group
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        offs_t = tl.arange(0, BT)
        mask_k = offs_k < K
        mask_v = offs_v < V
        start = tl.load(query_start_loc_ptr + row).to(tl.int64)
        end = tl.load(query_start_loc_ptr + row + 1).to(tl.int64)
        slot = tl.load(state_indices_ptr + row).to(tl.int64)
        has_init = tl.load(has_initial_state_ptr + row).to(tl.int32) != 0
        state_blk = state_ptr + ((slot * num_v_heads + hv) * K + offs_k[:, None]) * V + offs_v[None, :]
        mask_s = mask_k[:, None] & mask_v[None, :]
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if has_init:
            S = tl.load(state_blk, mask=mask_s, other=0.0).to(tl.float32)
        lower = offs_t[:, None] >= offs_t[None, :]
        strict = offs_t[:, None] > offs_t[None, :]
        eye = (offs_t[:, None] == offs_t[None, :]).to(tl.float32)
        for cs in range(start, end, BT):
            t = cs + offs_t
            mask_t = t < end
            mqk = mask_t[:, None] & mask_k[None, :]
            q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=mqk, other=0.0)
            k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=mqk, other=0.0)
            v = tl.load(
                v_ptr + t[:, None] * stride_vt + hv * stride_vh + offs_v[None, :],
                mask=mask_t[:, None] & mask_v[None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            if L2NORM:
                q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None]
                k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
            q = q * scale
            # Padding tokens past the row's end load g = 0, beta = 0, k = v = 0: they neither
            # decay nor write the state.
            g = tl.load(g_ptr + t * num_v_heads + hv, mask=mask_t, other=0.0)
            beta = tl.load(beta_ptr + t * num_v_heads + hv, mask=mask_t, other=0.0)
            gc = tl.cumsum(g, axis=0)  # [BT]
            g_last = tl.sum(g, axis=0)
            # exp only of non-positive exponents: the masked entries would overflow.
            decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
            kb = k * beta[:, None]
            A = tl.where(strict, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
            # L^-1 for L = I + A (unit lower triangular) by forward substitution, a row at a time.
            Tm = -A
            for i in range(1, BT):
                r = tl.sum(tl.where(offs_t[:, None] == i, Tm, 0.0), axis=0)  # row i
                r = r + tl.sum(r[:, None] * Tm, axis=0)
                Tm = tl.where(offs_t[:, None] == i, tl.where(offs_t < i, r, 0.0)[None, :], Tm)
            Linv = Tm + eye
            u = tl.dot(Linv, v * beta[:, None], input_precision="ieee")  # [BT, BV]
            w = tl.dot(Linv, kb * tl.exp(gc)[:, None], input_precision="ieee")  # [BT, BK]
            v_new = u - tl.dot(w, S, input_precision="ieee")
            attn = tl.where(lower, tl.dot(q, tl.trans(k), input_precision="ieee") * decay, 0.0)
            o = tl.dot(q * tl.exp(gc)[:, None], S, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
            tl.store(
                out_ptr + (t[:, None] * num_v_heads + hv) * V + offs_v[None, :],
                o.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :],
            )  # fmt: skip
            k_decayed = k * tl.exp(g_last - gc)[:, None]
            S = S * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")
        tl.store(state_blk, S.to(state_ptr.dtype.element_ty), mask=mask_s)


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> None:
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == num_tokens, f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert num_v_heads % num_k_heads == 0, f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads}"
    assert g.shape == beta.shape == (num_tokens, num_v_heads), f"g {tuple(g.shape)}, beta {tuple(beta.shape)}"
    assert g.dtype == beta.dtype == torch.float32, "g and beta are float32"
    assert state.shape[1:] == (num_v_heads, head_k, head_v), f"state {tuple(state.shape)} is not [slots, {num_v_heads}, {head_k}, {head_v}]"
    assert state.dtype == torch.float32


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [num_tokens, num_k_heads, head_k_dim], rows' tokens back to back
    k: torch.Tensor,  # [num_tokens, num_k_heads, head_k_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, head_v_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads] float32, log decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads] float32
    state: torch.Tensor,  # [num_slots, num_v_heads, head_k_dim, head_v_dim] float32, updated in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int
    state_indices: torch.Tensor,  # [num_reqs] int, slot of each row
    has_initial_state: torch.Tensor,  # [num_reqs] bool: start from the slot's state (else from zero)
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [num_tokens, num_v_heads, head_v_dim], dtype of v
    """Prefill: run each row's tokens through the delta rule from its state and leave the final
    state in its slot. Rows may be empty (the state is then kept, or zeroed without initial state)."""
    _check(q, k, v, g, beta, state)
    num_reqs = state_indices.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and has_initial_state.shape == (num_reqs,)
    if not use_triton(q.device):
        return chunk_gated_delta_rule_ref(
            q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state, use_qk_l2norm
        )
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.is_contiguous() and beta.is_contiguous()
    assert state.is_contiguous()
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if num_reqs == 0:
        return out
    bk = max(16, triton.next_power_of_2(head_k))
    bv = max(16, min(64, triton.next_power_of_2(head_v)))
    grid = (num_reqs, num_v_heads, triton.cdiv(head_v, bv))
    _chunk_gated_delta_rule_kernel[grid](
        q, k, v, g, beta, out, state, query_start_loc, state_indices, has_initial_state,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_v_heads, head_k, head_v, num_v_heads // num_k_heads, head_k**-0.5,
        L2NORM=use_qk_l2norm, BT=CHUNK, BK=bk, BV=bv,
    )  # fmt: skip
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as transformers and FLA compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = REF_CHUNK,
) -> torch.Tensor:
    """The specification: per row, the chunked delta rule of transformers' torch fallback."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds = query_start_loc.tolist()
    for row, (slot, has_init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        start, end = bounds[row], bounds[row + 1]
        init = state[slot] if has_init else torch.zeros_like(state[slot])
        if end == start:
            state[slot] = init
            continue
        o, final = _chunk_one(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], init,
                              use_qk_l2norm, chunk_size)  # fmt: skip
        out[start:end] = o.to(out.dtype)
        state[slot] = final
    return out


def _chunk_one(
    q: torch.Tensor,  # [T, Hk, K]
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, V]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, K, V] float32
    use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, Hv, V] float32, final state [Hv, K, V]
    group = v.shape[1] // q.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))  # [Hv, T, K]
    v, g, beta = v.float().transpose(0, 1), g.float().T, beta.float().T  # [Hv, T, V], [Hv, T]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    length = q.shape[1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, chunk_size, x.shape[-1]) for x in (q, k, v))  # [Hv, chunks, C, *]
    g, beta = g.reshape(h, -1, chunk_size), beta.reshape(h, -1, chunk_size)
    gc = g.cumsum(-1)  # [Hv, chunks, C]
    strict_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(strict_upper, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    lower = (kb @ k.transpose(-1, -2)) * decay  # the unit diagonal is implied by the solve
    u = torch.linalg.solve_triangular(lower, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_decayed = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [Hv, chunks, 1, 1]
    S = state.float()
    o = torch.empty_like(v)
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ S
        o[:, c] = q_decayed[:, c] @ S + attn[:, c] @ v_new
        S = S * chunk_decay[:, c] + k_decayed[:, c].transpose(-1, -2) @ v_new
    o = o.reshape(h, -1, o.shape[-1])[:, :length]
    return o.transpose(0, 1), S
