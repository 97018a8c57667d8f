"""Paged multi-head latent attention kernels: the latent cache write and the absorbed decode.

The MLA cache holds, per token, one row of `rank + rope` channels: the compressed latent
(kv_a_layernorm's output, `kv_lora_rank` wide) then the rotated decoupled key (`qk_rope_head_dim`),
shared by every head. In the absorbed form a decode query never expands that latent into K/V:
its no-rope part is first multiplied into the latent space (q_lat = q_nope @ W_UK per head), so

    score(h, j) = scale * (q_lat[h] . latent[j] + q_pe[h] . k_pe[j])
    out_lat[h]  = sum_j softmax_j(score(h, j)) * latent[j]

and the caller maps `out_lat` back through W_UV. Each op sits above its torch specification:

- `_write_latent_kernel` -> `write_latent()` / `write_latent_ref()`: one program per token
  stores its latent and rope key at its flat cache slot; slot -1 (a padding token of a
  CUDA-graph batch) writes nothing. A float8 e4m3 cache (kv_cache_dtype="fp8", scale 1, as the
  decoder's K/V: core_runner/attention/float8.py) gets both rounded to nearest even after
  saturating at +-448; a layernormed latent and a rotated rope key sit far inside that range.
- `_mla_decode_kernel` -> `mla_decode()` / `mla_decode_ref()`: one query token per row, grid
  (rows, head blocks, splits); FlashAttention-style online softmax over key tiles gathered
  through the row's block table, the BLOCK_H heads of a program stacked as the M dimension of
  both dots so that each latent tile is read once per head block. With splits > 1
  (`decode_splits`: while the launch has fewer programs than the GPU runs at once) each split
  takes a share of the row's tiles and the last to finish merges them, as the decoder's split-KV
  launch does (core_runner/attention/split_kv.py): a row's sums then run in an order that
  depends on the batch's row count. A row with seq_len 0 (a padding row) outputs zeros. No host
  reads of device tensors: graph-safe. Over a float8 cache each tile is widened after loading
  (exact: every e4m3 value is an fp16 value): with 16-bit q to fp16, the query scaled by the
  softmax scale first, as the decoder's attention does (`fp8_in_fp16`: one conversion
  instruction a pair of values on Hopper, against five to bf16); with fp32 q to fp32.
"""

from __future__ import annotations

import functools

import torch

from slotrunner.core_runner.attention.backend import copy_into_cache
from slotrunner.core_runner.attention.shared_prefix import fp8_in_fp16
from slotrunner.core_runner.attention.split_kv import split_kv_counters, split_kv_splits, split_kv_state
from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = (*_DTYPES, torch.float8_e4m3fn)  # float8: kv_cache_dtype="fp8"
_LOG2E = 1.4426950408889634

if HAS_TRITON:
    from slotrunner.core_runner.attention.kv_write import store_to_cache
    from slotrunner.core_runner.attention.split_kv import merge_when_last, split_tiles

    @triton.jit
    def _write_latent_kernel(
        latent_ptr,  # [num_tokens, rank]
        stride_lt,
        k_pe_ptr,  # [num_tokens, rope]
        stride_kt,
        cache_ptr,  # [num_blocks * block_size, rank + rope] contiguous
        slot_mapping_ptr,  # [num_tokens] int64, -1 = padding token
        RANK: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        FP8: tl.constexpr,  # float8 e4m3 cache: round as backend.to_cache_dtype does
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:
            return
        row = cache_ptr + slot * (RANK + ROPE)
        r = tl.arange(0, BLOCK_R)
        c = tl.load(latent_ptr + t * stride_lt + r, mask=r < RANK)
        p = tl.arange(0, BLOCK_P)
        k = tl.load(k_pe_ptr + t * stride_kt + p, mask=p < ROPE)
        store_to_cache(row + r, c, r < RANK, FP8)  # the K/V writers' store, float8 rounding included
        store_to_cache(row + RANK + p, k, p < ROPE, FP8)

    @triton.jit
    def _mla_decode_kernel(
        q_lat_ptr,  # [num_rows, num_heads, rank]
        stride_lr,
        stride_lh,
        q_pe_ptr,  # [num_rows, num_heads, rope]
        stride_pr,
        stride_ph,
        cache_ptr,  # [num_blocks * block_size, rank + rope] contiguous
        stride_c,  # rank + rope, passed at run time (see mla_decode)
        out_ptr,  # [num_rows, num_heads, rank] contiguous
        block_tables_ptr,  # [num_rows, max_num_blocks_per_req] int32
        stride_bt,
        seq_lens_ptr,  # [num_rows] int32
        scale,  # times log2(e): the softmax runs in exp2
        part_acc_ptr,  # [num_rows, NUM_HEADS, NUM_SPLITS, RANK] fp32 each split's state (NUM_SPLITS > 1)
        part_ml_ptr,  # [num_rows, NUM_HEADS, NUM_SPLITS, 2] fp32 running max (log2 units) and sum
        counters_ptr,  # [>= num_rows * head blocks] int32 split arrival counters (NUM_SPLITS > 1)
        NUM_HEADS: tl.constexpr,
        RANK: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,  # > 1: each row's key tiles split over programs (split_kv.py)
        FP8_F16: tl.constexpr,  # a float8 cache with 16-bit q: products in fp16 (fp8_in_fp16)
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = heads < NUM_HEADS
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        seq_len = tl.load(seq_lens_ptr + row)
        kv_start = 0
        kv_end = seq_len
        if NUM_SPLITS > 1:  # this program's share of the row's key tiles
            split = tl.program_id(2)
            per = split_tiles(seq_len, TILE_N, NUM_SPLITS) * TILE_N
            used = tl.maximum(tl.cdiv(seq_len, per), 1)  # split 0 runs even for a row with no key
            if split >= used:
                return  # past the row's last key: the merge reads only the splits before
            kv_start = split * per
            kv_end = tl.minimum(seq_len, kv_start + per)
        q_lat = tl.load(
            q_lat_ptr + row * stride_lr + heads[:, None] * stride_lh + r[None, :],
            mask=h_mask[:, None] & (r[None, :] < RANK), other=0.0,
        )  # fmt: skip
        q_pe = tl.load(
            q_pe_ptr + row * stride_pr + heads[:, None] * stride_ph + p[None, :],
            mask=h_mask[:, None] & (p[None, :] < ROPE), other=0.0,
        )  # fmt: skip
        if FP8_F16:  # q scaled first (fp16's range), so the scores need no scaling
            q_lat = (q_lat.to(tl.float32) * scale).to(tl.float16)
            q_pe = (q_pe.to(tl.float32) * scale).to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for start in range(kv_start, kv_end, TILE_N):
            pos = start + tl.arange(0, TILE_N)
            k_mask = pos < kv_end
            block = tl.load(block_tables_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=k_mask, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            entry = cache_ptr + slot[:, None] * stride_c
            c = tl.load(entry + r[None, :], mask=k_mask[:, None] & (r[None, :] < RANK), other=0.0)  # [TILE_N, BLOCK_R]
            k_pe = tl.load(entry + RANK + p[None, :], mask=k_mask[:, None] & (p[None, :] < ROPE), other=0.0)
            c, k_pe = c.to(q_lat.dtype), k_pe.to(q_lat.dtype)  # a float8 cache widens exactly; else no-ops
            s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)  # [BLOCK_H, TILE_N]
            if not FP8_F16:
                s = s * scale
            s = tl.where(k_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a key
            alpha = tl.exp2(m_i - m_new)
            prob = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, 1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision=DOT_PRECISION)
            m_i = m_new
        out_ptrs = out_ptr + row * (NUM_HEADS * RANK) + heads[:, None] * RANK + r[None, :]
        if NUM_SPLITS > 1:  # this split's state; the last split of the row to finish merges them
            part0 = (row * NUM_HEADS + heads) * NUM_SPLITS  # [BLOCK_H]
            part = part0 + split
            tl.store(part_ml_ptr + 2 * part, m_i, mask=h_mask)
            tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=h_mask)
            tl.store(part_acc_ptr + part[:, None] * RANK + r[None, :], acc, mask=h_mask[:, None] & (r[None, :] < RANK))
            counter = counters_ptr + row * tl.num_programs(1) + tl.program_id(1)
            merge_when_last(counter, used, part_acc_ptr, part_ml_ptr, part0, out_ptrs, h_mask, r, RANK, NUM_SPLITS)
            return
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # seq_len 0: acc and l_i are 0 -> zeros
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (r[None, :] < RANK))


def write_latent_ref(
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    latent: torch.Tensor,  # [num_tokens, rank]
    k_pe: torch.Tensor,  # [num_tokens, rope]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token
) -> None:
    keep = slot_mapping >= 0
    copy_into_cache(cache.view(-1, cache.shape[-1]), slot_mapping[keep], torch.cat([latent, k_pe], dim=-1)[keep])


def write_latent(
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope] contiguous
    latent: torch.Tensor,  # [num_tokens, rank], unit channel stride
    k_pe: torch.Tensor,  # [num_tokens, rope], unit channel stride
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token
) -> None:
    """Store each token's latent and rotated rope key at its flat cache slot."""
    num_tokens, rank = latent.shape
    rope = k_pe.shape[1]
    assert cache.shape[-1] == rank + rope, f"cache rows of {cache.shape[-1]} for a latent {rank} + rope {rope}"
    assert k_pe.shape[0] == num_tokens and slot_mapping.shape == (num_tokens,), "one slot and rope key per token"
    if not use_triton(latent.device):
        return write_latent_ref(cache, latent, k_pe, slot_mapping)
    assert cache.is_contiguous() and latent.stride(1) == 1 and k_pe.stride(1) == 1, "contiguous channels expected"
    if num_tokens == 0:
        return
    _write_latent_kernel[(num_tokens,)](
        latent, latent.stride(0), k_pe, k_pe.stride(0), cache, slot_mapping,
        RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
        FP8=cache.dtype == torch.float8_e4m3fn,
    )  # fmt: skip


def read_latents(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Cache rows `slots` of a flat [slots, rank + rope] cache, in the cache's dtype: a float8
    cache is gathered as bytes, as `copy_into_cache` writes it."""
    if flat.dtype.itemsize == 1:
        return flat.view(torch.uint8)[slots].view(flat.dtype)
    return flat[slots]


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Two programs per multiprocessor on a GPU; 1 elsewhere (the interpreter gains nothing)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_rows: int, head_blocks: int, device: torch.device) -> int:
    """Programs per (row, head block) of a decode launch: the decoder's split rule
    (`split_kv_splits`, with no row limit) for a launch of up to two programs per
    multiprocessor. One program per row leaves most of a GPU idle below ~130 rows, each walking
    all its row's latents in turn. Each split adds its float32 state (2 KB a head), written and
    read back by the merge; on one H200 (132 multiprocessors), 64 rows of DeepSeek-V2-Lite's
    shape at 640 tokens took 50.7 / 33.6 / 31.1 / 40.7 us at 1 / 2 / 4 / 8 splits
    (`benchmarks/mla_decode.py`): two programs per multiprocessor (4 splits) beat one (2)."""
    return split_kv_splits(num_rows, head_blocks, _target_programs(torch.device(device)))


def mla_decode_ref(
    q_lat: torch.Tensor,  # [num_rows, num_heads, rank]
    q_pe: torch.Tensor,  # [num_rows, num_heads, rope]
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    block_tables: torch.Tensor,  # [num_rows, max_num_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_rows] int32
    scale: float,
) -> torch.Tensor:  # [num_rows, num_heads, rank], q_lat's dtype
    """Each row's one query against its first seq_len cached tokens, in float32."""
    num_rows, num_heads, rank = q_lat.shape
    block_size = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    out = torch.zeros(num_rows, num_heads, rank, dtype=torch.float32, device=q_lat.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=cache.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        entries = read_latents(flat, slots).float()  # [seq_len, rank + rope]
        latent, k_pe = entries[:, :rank], entries[:, rank:]
        scores = (q_lat[i].float() @ latent.T + q_pe[i].float() @ k_pe.T) * scale  # [heads, seq_len]
        out[i] = scores.softmax(-1) @ latent
    return out.to(q_lat.dtype)


def mla_decode(
    q_lat: torch.Tensor,  # [num_rows, num_heads, rank], unit channel stride
    q_pe: torch.Tensor,  # [num_rows, num_heads, rope], unit channel stride
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope] contiguous
    block_tables: torch.Tensor,  # [num_rows, max_num_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_rows] int32
    scale: float,
    block_h: int = 16,  # heads per program (tl.dot needs >= 16 rows)
    tile_n: int = 32,  # cached tokens per key tile
    splits: int | None = None,  # programs per (row, head block); None: `decode_splits`
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # [num_rows, num_heads, rank], q_lat's dtype
    """Absorbed-form paged decode: one query token per row (see the module docstring)."""
    num_rows, num_heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    assert q_pe.shape[:2] == (num_rows, num_heads), f"q_pe {tuple(q_pe.shape)} for q_lat {tuple(q_lat.shape)}"
    assert cache.dim() == 3 and cache.shape[2] == rank + rope, f"cache {tuple(cache.shape)} for rank {rank} + rope {rope}"
    assert seq_lens.shape == (num_rows,) and block_tables.shape[0] == num_rows, "one block-table row and length per row"
    if not use_triton(q_lat.device):
        return mla_decode_ref(q_lat, q_pe, cache, block_tables, seq_lens, scale)
    assert cache.is_contiguous() and q_lat.stride(2) == 1 and q_pe.stride(2) == 1, "contiguous channels expected"
    assert q_lat.dtype in _DTYPES and cache.dtype in _CACHE_DTYPES, f"dtypes q {q_lat.dtype}, cache {cache.dtype}"
    out = torch.empty(num_rows, num_heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if num_rows == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = splits or decode_splits(num_rows, head_blocks, q_lat.device)
    part_acc = part_ml = counters = out  # placeholders, never touched without splits
    if splits > 1:
        part_acc, part_ml = split_kv_state(num_rows, num_heads, splits, rank, q_lat.device)
        counters = split_kv_counters(num_rows * head_blocks, q_lat.device)
    grid = (num_rows, head_blocks, splits)
    # The cache's row stride goes in as a run-time integer: Triton then vectorises the latent
    # loads only when it divides by 16 (576 = 512 + 64 does). As a constant, a width such as
    # 40 + 12 led the compiler to 16-byte loads of 8-byte-aligned half-precision rows (misaligned
    # address on one H200).
    _mla_decode_kernel[grid](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), cache, cache.stride(1), out,
        block_tables, block_tables.stride(0), seq_lens, float(scale) * _LOG2E, part_acc, part_ml, counters,
        NUM_HEADS=num_heads, RANK=rank, ROPE=rope, BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_P=max(16, triton.next_power_of_2(rope)), TILE_N=tile_n,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", NUM_SPLITS=splits,
        FP8_F16=fp8_in_fp16(cache.dtype, q_lat.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
