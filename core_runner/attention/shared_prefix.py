"""The shared-prefix launch of the Triton decode attention (`triton_attn.py`).

A decode-only step whose rows all read their first keys from the same cache blocks (a prompt
prefix that prefix caching hands to many requests; `AttentionMetadata.shared_prefix_len`, a whole
number of decode tiles) runs those keys here, ROWS rows per program, grid (cdiv(num_reqs, ROWS),
num_kv_heads): each key tile is read once per ROWS rows instead of once per row. The program
stores each row's online-softmax state (running max, sum, unnormalized accumulator), and the
decode launch (`SHARED_PREFIX`) starts from it at the first key past the prefix.

Every step of the online softmax here is the decode launch's own -- its BLOCK_M and TILE_N, the
same key tiles from position 0, the same operations in the same order -- so a row's output is
bitwise what the decode launch alone computes (tests/core_runner/attention/test_triton_attn.py and
test_triton_attn_gpu.py: on the interpreter and on the GPU). That is why the tile loop repeats the decode kernel's rather
than sharing a helper with different masking.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec
from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton


def fp8_in_fp16(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether attention over a float8 e4m3 cache takes its products in fp16: with 16-bit q. An
    e4m3 value widens to fp16 exactly in one instruction a pair on Hopper; to bf16, Triton goes
    through fp16 and fp32 (five a pair) for every key and value a decode step reads. Products in
    fp16 are also finer than bf16's; fp32 q keeps fp32 products."""
    return cache_dtype == torch.float8_e4m3fn and q_dtype in (torch.float16, torch.bfloat16)


if HAS_TRITON:

    @triton.jit
    def attention_q(q, scale, cache_dtype, KV_FP8: tl.constexpr, FP8_F16: tl.constexpr):
        """q as the products with the cache's keys take it. A float8 cache with 16-bit q is read
        in fp16 (`fp8_in_fp16`): q scaled by the softmax scale first, so that a large query
        cannot overflow fp16's range (the scores then need no scaling); fp32 q stays fp32."""
        if KV_FP8:
            if FP8_F16:
                q = (q.to(tl.float32) * scale).to(tl.float16)
        else:
            q = q.to(cache_dtype)
        return q

    @triton.jit
    def head_halves(x, M: tl.constexpr, D: tl.constexpr):
        """[M, D] -> its columns [:D // 2] and [D // 2:], each [M, D // 2] (registers only)."""
        return tl.split(tl.permute(tl.reshape(x, [M, 2, D // 2]), [0, 2, 1]))

    @triton.jit
    def _shared_prefix_kernel(
        q_ptr,  # [num_tokens, num_heads, head_dim]
        stride_qt,
        stride_qh,
        k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        block_table_ptr,  # [max_num_blocks_per_req] int32: row 0's, whose prefix blocks every row shares
        shared_len_ptr,  # [1] int32 keys in the shared prefix, a multiple of TILE_N
        query_start_loc_ptr,  # [num_reqs + 1] int32
        part_acc_ptr,  # [num_reqs, num_heads, HEAD_DIM] fp32 out: unnormalized accumulator
        part_ml_ptr,  # [num_reqs, num_heads, 2] fp32 out: running max (log2 units) and running sum
        num_reqs,
        scale,
        soft_cap,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        ROWS: tl.constexpr,  # batch rows per program: BLOCK_M // GROUP
        BLOCK_M: tl.constexpr,  # the decode launch's BLOCK_M, so that both run the same tile shapes
        TILE_N: tl.constexpr,  # the decode launch's TILE_N
        USE_SOFT_CAP: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr,
        FP8_F16: tl.constexpr,
    ):
        """The shared prefix of a decode batch, read once for ROWS rows at a time: each key tile
        is loaded once per program instead of once per row. Every step of the online softmax is
        the decode launch's own (same tile shapes, same key tiles from position 0, same
        operations in the same order), and the decode launch continues from the state stored
        here, so a row's output is bitwise what the decode launch alone computes."""
        kv_head = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        row = tl.program_id(0) * ROWS + m // GROUP  # [BLOCK_M]
        head = kv_head * GROUP + m % GROUP  # [BLOCK_M]
        in_batch = (m < ROWS * GROUP) & (row < num_reqs)
        q_start = tl.load(query_start_loc_ptr + row, mask=in_batch, other=0)
        num_q = tl.load(query_start_loc_ptr + row + 1, mask=in_batch, other=0) - q_start
        row_ok = in_batch & (num_q == 1)  # padding rows (no query) take no part
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + q_start.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM_P2]
        q = attention_q(q, scale, k_cache_ptr.dtype.element_ty, KV_FP8, FP8_F16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        n = tl.arange(0, TILE_N)
        kv_col = kv_head * HEAD_DIM
        shared = tl.load(shared_len_ptr)
        for tile_start in range(0, shared, TILE_N):
            k_pos = tile_start + n  # [TILE_N], all < shared: every key of the tile is real
            block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
            slot = block * BLOCK_SIZE + k_pos % BLOCK_SIZE
            k_off = slot[None, :] * (NUM_KV_HEADS * HEAD_DIM) + kv_col + d[:, None]  # [HEAD_DIM_P2, TILE_N]
            k_t = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None], other=0.0)
            if KV_FP8:
                k_t = k_t.to(q.dtype)
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
            if not FP8_F16:
                s = s * scale
            if USE_SOFT_CAP:
                s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
            # Every prefix key precedes every query: only rows outside the batch are masked.
            s = tl.where(row_ok[:, None], s * 1.4426950408889634, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_col + d[None, :]  # [TILE_N, HEAD_DIM_P2]
            v = tl.load(v_cache_ptr + v_off, mask=d_ok[None, :], other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        part = row.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head  # [BLOCK_M]
        tl.store(part_ml_ptr + 2 * part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


def shared_prefix_applies(spec: AttentionSpec, position_bias: torch.Tensor | None, sinks: torch.Tensor | None) -> bool:
    """Whether a layer runs a step's shared prefix as its own launch: not with a sliding
    window (its keys start per row), a position bias (per-distance) or sinks (the decode
    launch starts from the sink); such layers attend as if there were none."""
    return spec.sliding_window is None and position_bias is None and sinks is None


def shared_prefix_state(
    spec: AttentionSpec,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    meta: AttentionMetadata,
    shared: torch.Tensor,  # [1] int32 keys of the shared prefix
    block_m: int,  # the decode launch's BLOCK_M
    tile_n: int,  # the decode launch's TILE_N
    num_warps: int,
    num_stages: int,
    dot_precision: str,
    kv_fp8: bool,
    fp8_f16: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, num_heads, head_dim], [num_reqs, num_heads, 2] fp32
    """Run the shared prefix for every decode row; returns the state the decode launch takes."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads, n = spec.num_heads, meta.num_reqs
    group = num_heads // num_kv_heads
    part = torch.empty(n * num_heads * (head_dim + 2), dtype=torch.float32, device=q.device)  # one allocation
    split = n * num_heads * head_dim
    part_acc, part_ml = part[:split].view(n, num_heads, head_dim), part[split:].view(n, num_heads, 2)
    rows = block_m // group
    _shared_prefix_kernel[(triton.cdiv(n, rows), num_kv_heads)](
        q, q.stride(0), q.stride(1), kv_cache[0], kv_cache[1], meta.block_tables[0], shared, meta.query_start_loc,
        part_acc, part_ml, n, spec.scale, spec.logits_soft_cap or 1.0,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, ROWS=rows, BLOCK_M=block_m, TILE_N=tile_n,
        USE_SOFT_CAP=spec.logits_soft_cap is not None, DOT_PRECISION=dot_precision, KV_FP8=kv_fp8,
        FP8_F16=fp8_f16, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return part_acc, part_ml
