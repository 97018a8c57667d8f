"""TritonBackend: paged attention over the KV cache as Triton kernels (GPU; CPU via the interpreter).

A step's K/V write first (`kv_write.py`'s launch; or, for a layer that hands the backend its
rotary embedding as `rotate`, the rotary launch with the write in it: `KVWrite`,
models/layers/rotary_qk.py, one launch a layer fewer), then the kernels below, each above its
wrapper; their torch specification is `paged_attention_ref` (torch_ref.py):

- `_paged_attention_kernel` -> `paged_attention()`: FlashAttention-style online softmax over key
  tiles gathered through the block table, fp32 accumulation. The query heads sharing one KV head
  are packed into the M dimension (M row = query token x head of the group), so every K/V tile
  is loaded once per KV head. Over a float8 cache the decode launch takes its products over the
  head dim's two halves (`TileConfig.decode_head_halves`: fewer registers). Two launches of the same kernel:
    * decode launch, grid (num_reqs, num_kv_heads, splits): one program per (row, KV head) handles
      every row with exactly one query token -- all of a decode-only batch; in a batch of a few
      rows, `splits` programs share each row's key tiles and the last to finish merges them (`split_kv.py`).
    * prefill launch (only when max_query_len > 1), grid (num_tokens // BLOCK_Q + num_reqs,
      num_kv_heads): one program per (block of BLOCK_Q query tokens of one row, KV head), for
      rows with >= 2 query tokens. Row r owns programs [qsl[r] // BLOCK_Q + r, ...), an
      increasing sequence, so a program finds its row by binary search over query_start_loc.
- `_shared_prefix_kernel` (in `shared_prefix.py`), before the decode launch of a step whose rows share their first keys
  (`AttentionMetadata.shared_prefix_len`: a prompt prefix that prefix caching hands to many
  requests, in whole decode tiles), grid (cdiv(num_reqs, ROWS), num_kv_heads): one program runs
  those keys for ROWS rows at once, so each key tile is read once per ROWS rows instead of once
  per row, and stores its online-softmax state (running max, sum, accumulator); the decode
  launch starts from that state at the first key past the prefix. Layers with a sliding window,
  a position bias or sinks attend without it (`shared_prefix_applies`).

Batch invariance: a row with one query token always takes the decode launch, a longer row always
the prefill launch, whatever else is in the batch; a program reads only its own row's keys, in
key tiles aligned to multiples of TILE_N counted from position 0. A row's output is therefore a
function of that row alone -- and of whether its decode batch is small enough to split. The shared-prefix launch keeps this bitwise: it runs the decode
launch's tile shapes over the same key tiles in the same order, so a decode row's output does not
depend on whether its batch shares a prefix (tested against the decode launch alone). CUDA
graphs: no host reads of device tensors; the grids depend on num_reqs, max_query_len and the
query tensor's shape only.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec, Rotate
from slotrunner.core_runner.attention.kv_write import CACHE_DTYPES, DTYPES, KVWrite
from slotrunner.core_runner.attention.shared_prefix import fp8_in_fp16, shared_prefix_applies, shared_prefix_state
from slotrunner.core_runner.attention.split_kv import attention_splits, split_kv_counters, split_kv_state
from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.triton_utils import HAS_TRITON, pdl_launch, tl, triton, use_triton

if HAS_TRITON:
    from slotrunner.core_runner.attention.shared_prefix import attention_q, head_halves
    from slotrunner.core_runner.attention.split_kv import merge_when_last, split_tiles
    from slotrunner.core_runner.triton_utils import pdl_enter

FUSED_KV_WRITE = True  # a layer's rotary launch writes its K/V (`KVWrite`); benchmarks turn it off (read per forward)


if HAS_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,  # [num_tokens, num_heads, head_dim]
        stride_qt,
        stride_qh,
        k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        out_ptr,  # [num_tokens, num_heads, head_dim]
        stride_ot,
        stride_oh,
        block_tables_ptr,  # [num_reqs, max_num_blocks_per_req] int32
        stride_bt,
        seq_lens_ptr,  # [num_reqs] int32
        query_start_loc_ptr,  # [num_reqs + 1] int32
        bias_ptr,  # [num_heads, num_distances] (unused unless HAS_BIAS)
        stride_bh,
        stride_bd,
        num_distances,
        sinks_ptr,  # [num_heads] (unused unless HAS_SINKS)
        shared_len_ptr,  # [1] int32 keys of the shared prefix (unused unless SHARED_PREFIX)
        part_acc_ptr,  # [num_reqs, num_heads, HEAD_DIM] fp32 the prefix launch's state (SHARED_PREFIX),
        # or out: [num_reqs, num_heads, NUM_SPLITS, HEAD_DIM] each split's state (NUM_SPLITS > 1)
        part_ml_ptr,  # [num_reqs, num_heads, (NUM_SPLITS,) 2] fp32 running max and sum, the same way
        counters_ptr,  # [>= num_reqs * NUM_KV_HEADS] int32 split arrival counters (NUM_SPLITS > 1)
        row_order_ptr,  # [num_reqs] int32 the rows, longest first (unused unless ROW_ORDER)
        num_reqs,
        scale,
        soft_cap,
        sliding_window,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,  # query heads per KV head
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_Q: tl.constexpr,  # query tokens per program
        BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two >= 16
        TILE_N: tl.constexpr,  # keys per tile
        DECODE: tl.constexpr,  # program id 0 = batch row (rows with one query token only)
        USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr,  # float8 cache: keys and values are widened to q's dtype after loading
        FP8_F16: tl.constexpr,  # with KV_FP8 and 16-bit q: products in fp16 (fp8_in_fp16)
        SHARED_PREFIX: tl.constexpr = False,  # decode launch: start from the prefix launch's state
        NUM_SPLITS: tl.constexpr = 1,  # decode launch: > 1 splits each row's key tiles (split_kv.py)
        OFFSETS_I32: tl.constexpr = False,  # the cache's element offsets fit in int32 (TileConfig.int32_offsets)
        HALVES: tl.constexpr = False,  # products over the head dim's two halves (TileConfig.decode_head_halves)
        PDL: tl.constexpr = False,  # triton_utils.pdl_launch
        ROW_ORDER: tl.constexpr = False,  # decode launch: grid (KV heads, rows), rows in row_order's order
        PREFETCH_BLOCKS: tl.constexpr = False,  # each tile's block ids loaded a tile early (TileConfig.decode_prefetch_blocks)
        CAUSAL: tl.constexpr = True,  # False: every query token of a row sees all of its keys (cross-attention)
    ):
        pdl_enter(PDL)
        if ROW_ORDER:
            kv_head = tl.program_id(0)
            row = tl.load(row_order_ptr + tl.program_id(1))
            q_block = 0
        elif DECODE:
            kv_head = tl.program_id(1)
            row = tl.program_id(0)
            q_block = 0
        else:
            kv_head = tl.program_id(1)
            # Largest row r with qsl[r] // BLOCK_Q + r <= pid: row r's programs start there.
            pid = tl.program_id(0)
            lo: tl.int32 = 0
            hi = num_reqs
            while lo < hi:
                mid = (lo + hi) // 2
                if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
                    lo = mid + 1
                else:
                    hi = mid
            row = lo - 1
            q_block = pid - (tl.load(query_start_loc_ptr + row) // BLOCK_Q + row)
        q_start = tl.load(query_start_loc_ptr + row)
        num_q = tl.load(query_start_loc_ptr + row + 1) - q_start
        if DECODE:
            if num_q != 1:  # padding row (0) or a row of the prefill launch (>= 2)
                return
        else:
            if (num_q < 2) | (q_block * BLOCK_Q >= num_q):
                return
        seq_len = tl.load(seq_lens_ptr + row)
        context = seq_len - num_q  # keys cached before this step

        m = tl.arange(0, BLOCK_M)
        q_local = q_block * BLOCK_Q + m // GROUP  # [BLOCK_M] query token within the row
        head = kv_head * GROUP + m % GROUP  # [BLOCK_M]
        row_ok = (m < BLOCK_Q * GROUP) & (q_local < num_q)
        q_pos = context + q_local  # [BLOCK_M] absolute position
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        q_tok = (q_start + q_local).to(tl.int64)
        q = tl.load(
            q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM_P2]
        q = attention_q(q, scale, k_cache_ptr.dtype.element_ty, KV_FP8, FP8_F16)

        first_pos = context + q_block * BLOCK_Q
        kv_end = seq_len
        if CAUSAL:
            kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # keys past the last query are masked
        kv_start = 0
        split = 0
        if NUM_SPLITS > 1:  # this program's share of the row's key tiles (split_kv.py)
            split = tl.program_id(2)
            per = split_tiles(kv_end, TILE_N, NUM_SPLITS) * TILE_N
            used = tl.maximum(tl.cdiv(kv_end, per), 1)  # split 0 runs even for a row with no key
            if split >= used:
                return  # past the row's last key: the merge reads only the splits before
        if USE_WINDOW:
            # Tiles stay aligned to multiples of TILE_N, so the tiling of a row's keys does not
            # depend on how its queries are blocked.
            kv_start = (tl.maximum(first_pos - sliding_window + 1, 0) // TILE_N) * TILE_N
        if NUM_SPLITS > 1:
            kv_start = tl.maximum(kv_start, split * per)
            kv_end = tl.minimum(kv_end, (split + 1) * per)

        if HAS_SINKS:  # the sink as a key seen first (by split 0): running max = its logit, running sum = 1
            m_i = tl.where(split == 0, tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634, float("-inf"))
            l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        if SHARED_PREFIX:
            # The prefix launch ran this row's first `shared` keys, tile by tile as the loop
            # below would have: continue from its running max, sum and accumulator.
            kv_start = tl.load(shared_len_ptr)
            part = row.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head  # [BLOCK_M]
            m_i = tl.load(part_ml_ptr + 2 * part, mask=row_ok, other=float("-inf"))
            l_i = tl.load(part_ml_ptr + 2 * part + 1, mask=row_ok, other=0.0)
            acc = tl.load(
                part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
        if HALVES:  # (HEAD_DIM a power of two: no padded dims to mask)
            dh = tl.arange(0, HEAD_DIM // 2)
            q_lo, q_hi = head_halves(q, BLOCK_M, HEAD_DIM)
            acc_lo, acc_hi = head_halves(acc, BLOCK_M, HEAD_DIM)
        n = tl.arange(0, TILE_N)
        block_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        kv_col = kv_head * HEAD_DIM
        if PREFETCH_BLOCKS:  # the first tile's block ids; each tile then loads the next one's
            block_next = tl.load(block_row + (kv_start + n) // BLOCK_SIZE, mask=kv_start + n < kv_end, other=0)
        for tile_start in range(kv_start, kv_end, TILE_N):
            k_pos = tile_start + n  # [TILE_N]
            k_ok = k_pos < kv_end
            if PREFETCH_BLOCKS:
                block = block_next
                block_next = tl.load(block_row + (k_pos + TILE_N) // BLOCK_SIZE, mask=k_pos + TILE_N < kv_end, other=0)
            else:
                block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            if not OFFSETS_I32:
                block = block.to(tl.int64)
            slot = block * BLOCK_SIZE + k_pos % BLOCK_SIZE  # [TILE_N]
            kv_off = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_col  # [TILE_N] each key's first element, K and V alike
            if HALVES:  # the second product accumulates onto the first: the sums of one product
                k_off = kv_off[None, :] + dh[:, None]  # [HEAD_DIM // 2, TILE_N]
                k_lo = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :], other=0.0)
                s = tl.dot(q_lo, k_lo.to(q.dtype), input_precision=DOT_PRECISION)
                k_hi = tl.load(k_cache_ptr + k_off + HEAD_DIM // 2, mask=k_ok[None, :], other=0.0)
                s = tl.dot(q_hi, k_hi.to(q.dtype), s, input_precision=DOT_PRECISION)
            else:
                k_off = kv_off[None, :] + d[:, None]  # [HEAD_DIM_P2, TILE_N]
                k_t = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
                s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
            if not FP8_F16:  # (fp16 products: q came scaled)
                s = s * scale
            if USE_SOFT_CAP:
                s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)  # cap * tanh(s / cap)
            dist = q_pos[:, None] - k_pos[None, :]
            allowed = row_ok[:, None] & k_ok[None, :]
            if CAUSAL:
                allowed = allowed & (dist >= 0)
            if USE_WINDOW:
                allowed = allowed & (dist < sliding_window)
            if HAS_BIAS:
                bias = tl.load(
                    bias_ptr + head[:, None] * stride_bh + tl.minimum(dist, num_distances - 1) * stride_bd,
                    mask=allowed,
                    other=0.0,
                )
                s += bias.to(tl.float32)
            s = tl.where(allowed, s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no allowed key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(q.dtype)
            if HALVES:
                v_off = kv_off[:, None] + dh[None, :]  # [TILE_N, HEAD_DIM // 2]
                v_lo = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None], other=0.0)
                acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(q.dtype), input_precision=DOT_PRECISION)
                v_hi = tl.load(v_cache_ptr + v_off + HEAD_DIM // 2, mask=k_ok[:, None], other=0.0)
                acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(q.dtype), input_precision=DOT_PRECISION)
            else:
                v_off = kv_off[:, None] + d[None, :]  # [TILE_N, HEAD_DIM_P2]
                v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
        if HALVES:
            acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), [0, 2, 1]), [BLOCK_M, HEAD_DIM])
        out_ptrs = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        if NUM_SPLITS > 1:  # this split's state; the last split of the row to finish merges them
            part0 = (row.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS  # [BLOCK_M]
            part = part0 + split
            tl.store(part_ml_ptr + 2 * part, m_i, mask=row_ok)
            tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            counter = counters_ptr + row * NUM_KV_HEADS + kv_head
            merge_when_last(counter, used, part_acc_ptr, part_ml_ptr, part0, out_ptrs, row_ok, d, HEAD_DIM, NUM_SPLITS)
            return
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    spec: AttentionSpec,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; tokens past query_start_loc[num_reqs] are padding
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    meta: AttentionMetadata,
    position_bias: torch.Tensor | None = None,  # [num_heads, num_distances]
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] contiguous
    tiles: TileConfig = TileConfig(),
    sinks: torch.Tensor | None = None,  # [num_heads]
    causal: bool = True,  # False: each query token sees every key of its row (specification: cross_attention_ref)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding tokens left as given
    """Causal paged attention of every real query token (specification: paged_attention_ref)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads = q.shape[0], spec.num_heads
    assert (num_heads, num_kv_heads, head_dim) == (spec.num_heads, spec.num_kv_heads, spec.head_dim), (
        f"spec {spec} does not match the KV cache {tuple(kv_cache.shape)}"
    )
    assert q.shape == (num_tokens, num_heads, head_dim) and q.stride(-1) == 1, f"q {tuple(q.shape)} {q.stride()}"
    assert kv_cache.is_contiguous(), "the paged KV cache must be contiguous"
    assert q.dtype in DTYPES and kv_cache.dtype in CACHE_DTYPES, f"dtypes q {q.dtype}, cache {kv_cache.dtype}"
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    compute_dtype = q.dtype if kv_fp8 else kv_cache.dtype
    fp8_f16 = fp8_in_fp16(kv_cache.dtype, q.dtype)
    assert meta.block_tables.stride(-1) == 1, "block table rows must be contiguous"
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if meta.num_reqs == 0 or num_tokens == 0:
        return out
    if position_bias is not None:
        assert position_bias.dim() == 2 and position_bias.shape[0] == num_heads, (
            f"position_bias {tuple(position_bias.shape)} for {num_heads} heads"
        )
    assert sinks is None or sinks.shape == (num_heads,), f"sinks {tuple(sinks.shape)} for {num_heads} heads"
    assert causal or (spec.sliding_window is None and position_bias is None and sinks is None), (
        "attention without the causal mask takes no sliding window, position bias or sinks"
    )
    group = num_heads // num_kv_heads
    decode_block_m = max(16, triton.next_power_of_2(group))
    shared = meta.shared_prefix_len if shared_prefix_applies(spec, position_bias, sinks) else None
    # fp32 models want fp32 products, not TF32 (ignored for 16-bit inputs).
    dot_precision = "ieee" if compute_dtype == torch.float32 else "tf32"
    part_acc = part_ml = q  # placeholders, never read without a shared prefix or splits
    counters = meta.seq_lens  # placeholder, never touched without splits
    # Decode-only steps split (a step with a prefill row is eager: its decode rows take one
    # program each, sparing it the split state and the merge).
    splits = 1
    if shared is None and meta.max_query_len == 1:
        splits = tiles.decode_splits or attention_splits(meta.num_reqs, num_kv_heads, tiles.split_kv_programs, tiles.split_kv_max)
    if splits > 1:
        part_acc, part_ml = split_kv_state(meta.num_reqs, num_heads, splits, head_dim, q.device)
        counters = split_kv_counters(meta.num_reqs * num_kv_heads, q.device)
    if shared is not None:  # the keys every row shares, once per group of rows: the decode launch continues from there
        part_acc, part_ml = shared_prefix_state(
            spec, q, kv_cache, meta, shared, decode_block_m, tiles.decode_tile_n, tiles.num_warps, tiles.shared_num_stages,
            dot_precision, kv_fp8, fp8_f16,
        )  # fmt: skip
    no_bias = position_bias is None
    # Programs start in grid order and each runs its row's key tiles in turn: with an order (long
    # rows first; TileConfig.decode_longest_first), the card does not end with a few long rows'
    # programs running alone.
    order = meta.decode_order if tiles.decode_longest_first else None
    args = (
        q, q.stride(0), q.stride(1), kv_cache[0], kv_cache[1], out, out.stride(0), out.stride(1),
        meta.block_tables, meta.block_tables.stride(0), meta.seq_lens, meta.query_start_loc,
        q if no_bias else position_bias, 0 if no_bias else position_bias.stride(0),
        0 if no_bias else position_bias.stride(1), 1 if no_bias else position_bias.shape[1],
        sinks if sinks is not None else q, shared if shared is not None else meta.seq_lens, part_acc, part_ml, counters,
        meta.seq_lens if order is None else order, meta.num_reqs, spec.scale, spec.logits_soft_cap or 1.0, spec.sliding_window or 0,
    )  # fmt: skip
    common = dict(
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        USE_WINDOW=spec.sliding_window is not None,
        USE_SOFT_CAP=spec.logits_soft_cap is not None,
        HAS_BIAS=position_bias is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision,
        KV_FP8=kv_fp8,
        FP8_F16=fp8_f16,
        OFFSETS_I32=tiles.int32_offsets and kv_cache.numel() < 2**32,  # each of K and V under 2^31 elements
        CAUSAL=causal,
        num_warps=tiles.num_warps,
        **pdl_launch(q.device),
    )
    # Rows with one query token: always this launch, so a decode row's result never depends on
    # whether prefill rows share its batch.
    grid = (meta.num_reqs, num_kv_heads, splits) if order is None else (num_kv_heads, meta.num_reqs, splits)
    _paged_attention_kernel[grid](
        *args,
        ROW_ORDER=order is not None,
        BLOCK_Q=1,
        BLOCK_M=decode_block_m,
        TILE_N=tiles.decode_tile_n,
        DECODE=True,
        SHARED_PREFIX=shared is not None,
        NUM_SPLITS=splits,
        HALVES=tiles.decode_head_halves and kv_fp8 and head_dim == common["HEAD_DIM_P2"] and head_dim >= 32,
        PREFETCH_BLOCKS=tiles.decode_prefetch_blocks,
        num_stages=tiles.decode_num_stages,
        **({"maxnreg": tiles.decode_maxnreg} if tiles.decode_maxnreg else {}),
        **common,
    )
    if meta.max_query_len > 1:
        block_q = max(1, tiles.prefill_block_m // group)
        # sum over rows of cdiv(num_q, block_q) <= num_tokens // block_q + num_reqs
        grid = (num_tokens // block_q + meta.num_reqs, num_kv_heads)
        _paged_attention_kernel[grid](
            *args,
            BLOCK_Q=block_q,
            BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
            TILE_N=tiles.prefill_tile_n,
            DECODE=False,
            num_stages=tiles.prefill_num_stages,
            **{**common, "num_warps": tiles.prefill_warps(common["HEAD_DIM_P2"])},
        )
    return out


class TritonBackend(AttentionBackend):
    """Paged attention as Triton kernels: CUDA-graph safe, batch invariant (see the module doc)."""

    name = "triton"

    def __init__(self, tiles: TileConfig = TileConfig()) -> None:
        self.tiles = tiles

    @property
    def shared_prefix_granule(self) -> int:
        """The decode launch's key tile: a shared prefix is a whole number of them."""
        return self.tiles.decode_tile_n

    @property
    def orders_decode_rows(self) -> bool:
        return self.tiles.decode_longest_first

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        position_bias: torch.Tensor | None = None,  # [num_heads, num_distances]
        sinks: torch.Tensor | None = None,  # [num_heads]
        rotate: Rotate | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert use_triton(q.device), f"TritonBackend cannot run on {q.device}: the runner picks one with select_attn_backend()"
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kv = KVWrite(kv_cache, v, meta.slot_mapping, out)
        if rotate is None:
            kv.write(k)
        elif FUSED_KV_WRITE:
            q, k = rotate(q, k, kv)
        else:
            q, k = rotate(q, k, None)
            kv.write(k)
        return paged_attention(spec, q, kv_cache, meta, position_bias, out, self.tiles, sinks)
