"""RoPE on q and k in one launch, optionally after a per-head RMSNorm (Qwen3's q_norm/k_norm).

`_rotary_qk_kernel` (Triton, one program per token and block of heads, writing q and k in place)
-> `rotary_qk()` (dispatch) -> `rotary_qk_ref()` (the torch specification, and what runs where
Triton does not). Neox layout: the first rotary_dim channels of a head are two halves rotated
against each other; the rest pass through. The kernel rounds where the reference rounds: after
the norm (as `RMSNorm` does) and once after the rotation, whose products are not fused into fma
(torch computes them in separate kernels). M-RoPE (mrope.py) and the vision tower call `_rotate`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slotrunner.core_runner.attention.kv_write import KVWrite
from slotrunner.core_runner.cpu.layer_ops import native_for, rms_norm_native, rotary_qk_native
from slotrunner.core_runner.triton_utils import HAS_TRITON, pdl_launch, tl, triton, use_triton
from slotrunner.models.layers.norm import rms_norm_ref


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before RoPE (Qwen3's q_norm / k_norm; Gemma3's with
    `unit_offset`, scaling by 1 + weight as norm.py's `rms_norm_ref` does)."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    q_eps: float
    k_eps: float
    unit_offset: bool = False


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def rotary_qk_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_position, rotary_dim]: cos half | sin half
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if qk_norm is not None:
        q = rms_norm_ref(q, qk_norm.q_weight, qk_norm.q_eps, unit_offset=qk_norm.unit_offset)
        k = rms_norm_ref(k, qk_norm.k_weight, qk_norm.k_eps, unit_offset=qk_norm.unit_offset)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # each [num_tokens, rotary_dim // 2]
    rotary_dim = cos_sin.shape[-1]
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


# Heads of q (and of k) one program rotates: grid (tokens, cdiv(heads, block)). Below
# WIDE_FROM_TOKENS tokens MAX_BLOCK_H, from there WIDE_BLOCK_H. On one H100 (Qwen3-0.6B's 16/8
# heads, 4 warps, benchmarks/RESULTS.md 2026-12-07): 8 heads are faster at 64-256 tokens (float8
# cache 3.8 against 4.1 us at 256), 16 from 1,024 tokens up (bf16 6.2 -> 5.5 us at 1,024, 10.7
# -> 9.2 at 2,048, 67.5 -> 60-64 at 8,192; float8 10.9 -> 10.3, 20.4 -> 18.6, 84.4 -> 77).
MAX_BLOCK_H = 8
WIDE_BLOCK_H = 16
WIDE_FROM_TOKENS = 1024
NUM_WARPS = 4  # the launch's warps (benchmarks/rotary_kernel.py varies both)

if HAS_TRITON:
    from slotrunner.core_runner.attention.kv_write import store_to_cache
    from slotrunner.core_runner.triton_utils import pdl_enter

    @triton.jit
    def _rope_heads(
        x_ptr,  # this token's row of q or k: heads at head_stride, channels contiguous
        head_stride,
        num_heads,
        head0,  # first head of this program
        cos,  # [1, BLOCK_HALF] float32
        sin,  # [1, BLOCK_HALF] float32
        w_ptr,  # [head_dim] norm weight (unused without HAS_NORM)
        eps,
        head_dim,
        half,  # rotary_dim // 2
        inv_head_dim,
        HAS_NORM: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_REST: tl.constexpr,
        cache_ptr=None,  # this token's K row of the cache ([heads, head_dim] contiguous; CACHE only)
        cache_heads=0,  # heads whose rotated K goes to the cache too: num_heads, or 0 for a padding token
        CACHE: tl.constexpr = False,
        KV_FP8: tl.constexpr = False,
    ):
        dtype = x_ptr.dtype.element_ty
        heads = head0 + tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK_HALF)
        row = x_ptr + heads[:, None] * head_stride
        mask = (heads < num_heads)[:, None] & (offs < half)[None, :]
        x1 = tl.load(row + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            # The channels past rotary_dim count in the norm but are not rotated.
            offs_r = 2 * half + tl.arange(0, BLOCK_REST)
            mask_r = (heads < num_heads)[:, None] & (offs_r < head_dim)[None, :]
            xr = tl.load(row + offs_r[None, :], mask=mask_r, other=0.0).to(tl.float32)
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
            inv = tl.math.rsqrt(ss * inv_head_dim + eps)[:, None]
            w1 = tl.load(w_ptr + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + half + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
            wr = tl.load(w_ptr + offs_r, mask=offs_r < head_dim, other=0.0).to(tl.float32)[None, :]
            if UNIT_OFFSET:  # Gemma's RMSNorm: h * (1 + w) in fp32, rounded once
                x1 = (x1 * inv * (1.0 + w1)).to(dtype).to(tl.float32)
                x2 = (x2 * inv * (1.0 + w2)).to(dtype).to(tl.float32)
                xr = xr * inv * (1.0 + wr)
            else:  # RMSNorm's roundings: h.to(dtype), then weight * h in dtype.
                x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
                x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
                xr = (xr * inv).to(dtype).to(tl.float32) * wr
            tl.store(row + offs_r[None, :], xr.to(dtype), mask=mask_r)
        y1 = (x1 * cos - x2 * sin).to(dtype)
        y2 = (x2 * cos + x1 * sin).to(dtype)
        tl.store(row + offs[None, :], y1, mask=mask)
        tl.store(row + half + offs[None, :], y2, mask=mask)
        if CACHE:
            c_row = cache_ptr + heads[:, None] * head_dim
            c_mask = (heads < cache_heads)[:, None] & (offs < half)[None, :]
            store_to_cache(c_row + offs[None, :], y1, c_mask, KV_FP8)
            store_to_cache(c_row + half + offs[None, :], y2, c_mask, KV_FP8)
            offs_r = 2 * half + tl.arange(0, BLOCK_REST)
            if not HAS_NORM:  # the channels past rotary_dim, as they are
                xr = tl.load(row + offs_r[None, :], mask=(heads < num_heads)[:, None] & (offs_r < head_dim)[None, :], other=0.0)
            store_to_cache(c_row + offs_r[None, :], xr.to(dtype), (heads < cache_heads)[:, None] & (offs_r < head_dim)[None, :], KV_FP8)

    @triton.jit
    def _rotary_qk_kernel(
        positions_ptr,  # [num_tokens]
        q_ptr,  # [num_tokens, num_heads, head_dim], strides q_token_stride, q_head_stride, 1
        q_token_stride,
        q_head_stride,
        num_heads,
        k_ptr,  # [num_tokens, num_kv_heads, head_dim], strides k_token_stride, k_head_stride, 1
        k_token_stride,
        k_head_stride,
        num_kv_heads,
        cos_sin_ptr,  # [max_position, 2 * half] contiguous
        q_w_ptr,  # [head_dim] (unused without HAS_NORM)
        k_w_ptr,  # [head_dim] (unused without HAS_NORM)
        q_eps,
        k_eps,
        head_dim,
        half,
        inv_head_dim,
        v_ptr,  # [num_tokens, num_kv_heads, head_dim], strides v_token_stride, v_head_stride, 1 (CACHE only)
        v_token_stride,
        v_head_stride,
        k_cache_ptr,  # [slots, num_kv_heads, head_dim] contiguous (CACHE only)
        v_cache_ptr,
        slot_mapping_ptr,  # [num_tokens] int64, -1 = padding token (CACHE only)
        out_ptr,  # [num_tokens, OUT_ROW] the attention's output, zeroed at padding tokens (CACHE only)
        HAS_NORM: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_REST: tl.constexpr,
        CACHE: tl.constexpr,  # also write_kv_triton's work: K (rotated) and V into the cache
        KV_FP8: tl.constexpr,
        BLOCK_D: tl.constexpr,  # power of two >= head_dim (CACHE)
        OUT_ROW: tl.constexpr,
        BLOCK_OUT: tl.constexpr,
        PDL: tl.constexpr = False,  # triton_utils.pdl_launch
    ):
        pdl_enter(PDL)
        token = tl.program_id(0).to(tl.int64)
        head0 = tl.program_id(1) * BLOCK_H
        pos = tl.load(positions_ptr + token).to(tl.int64)
        offs = tl.arange(0, BLOCK_HALF)
        cs_row = cos_sin_ptr + pos * (2 * half)
        cos = tl.load(cs_row + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(cs_row + half + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
        _rope_heads(q_ptr + token * q_token_stride, q_head_stride, num_heads, head0, cos, sin, q_w_ptr, q_eps,
                    head_dim, half, inv_head_dim, HAS_NORM, UNIT_OFFSET, BLOCK_H, BLOCK_HALF, BLOCK_REST)
        if CACHE:  # kv_write.py's _write_kv_kernel, for this program's KV heads
            raw = tl.load(slot_mapping_ptr + token).to(tl.int64)
            cache_heads = tl.where(raw >= 0, num_kv_heads, 0)  # a padding token writes nothing
            slot = tl.maximum(raw, 0)
            _rope_heads(k_ptr + token * k_token_stride, k_head_stride, num_kv_heads, head0, cos, sin, k_w_ptr, k_eps,
                        head_dim, half, inv_head_dim, HAS_NORM, UNIT_OFFSET, BLOCK_H, BLOCK_HALF, BLOCK_REST,
                        k_cache_ptr + slot * (num_kv_heads * head_dim), cache_heads, True, KV_FP8)
            heads = head0 + tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + d, mask=(heads < num_kv_heads) & (d < head_dim))
            v_dst = v_cache_ptr + slot * (num_kv_heads * head_dim) + heads * head_dim + d
            store_to_cache(v_dst, v, (heads < cache_heads) & (d < head_dim), KV_FP8)
            if tl.program_id(1) == 0:  # a padding token's output row stays zero (the attention skips it)
                o = tl.arange(0, BLOCK_OUT)
                tl.store(out_ptr + token * OUT_ROW + o, tl.zeros([BLOCK_OUT], out_ptr.dtype.element_ty), mask=o < tl.where(raw < 0, OUT_ROW, 0))
        else:
            _rope_heads(k_ptr + token * k_token_stride, k_head_stride, num_kv_heads, head0, cos, sin, k_w_ptr, k_eps,
                        head_dim, half, inv_head_dim, HAS_NORM, UNIT_OFFSET, BLOCK_H, BLOCK_HALF, BLOCK_REST)


def rotary_qk(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], unit channel stride
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], unit channel stride
    cos_sin: torch.Tensor,  # [max_position, rotary_dim]: cos half | sin half
    qk_norm: QKNorm | None = None,
    kv: KVWrite | None = None,  # this step's K/V write, handed over by the attention backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first rotary_dim channels of each head of q and k, after a per-head RMSNorm
    when `qk_norm` is given. Where Triton runs: one launch that writes q and k in place and
    returns them; for float32 on a CPU, native calls (core_runner/cpu/layer_ops.py) that do the
    same; elsewhere the reference, which returns new tensors. Callers use the returned
    tensors and must not read q or k afterwards.

    With `kv` (the Triton attention backend's `rotate` hook), the rotated K and V also go into
    the KV cache, as `kv.write(k)` would put them: in the same launch where the kernel runs (a
    launch a layer fewer), by `kv.write` after the rotation elsewhere."""
    num_tokens, num_heads, head_dim = q.shape
    rotary_dim = cos_sin.shape[-1]
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)} for {num_tokens} tokens"
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, f"rotary_dim {rotary_dim} for head_dim {head_dim}"
    if qk_norm is not None:
        assert qk_norm.q_weight.shape == qk_norm.k_weight.shape == (head_dim,), "q/k norm weights are not [head_dim]"
    fusable = (
        use_triton(q.device)
        and num_tokens > 0
        and q.stride(-1) == k.stride(-1) == 1
        and q.dtype == k.dtype
        and cos_sin.is_contiguous()
        # In place needs the reference's output dtype to be q's: a wider norm weight would promote it
        # (not Gemma's unit-offset norm, whose output keeps q's dtype).
        and (
            qk_norm is None
            or qk_norm.unit_offset
            or all(torch.promote_types(w.dtype, q.dtype) == q.dtype for w in qk_norm[:2])
        )
    )
    if kv is not None and not (fusable and _writes_cache(q, k, kv)):
        q, k = rotary_qk(positions, q, k, cos_sin, qk_norm)
        kv.write(k)
        return q, k
    if not fusable:
        lib = None
        if q.device.type == "cpu" and num_tokens > 0 and q.stride(-1) == k.stride(-1) == 1:
            lib = native_for(q, k, cos_sin, *(qk_norm[:2] if qk_norm is not None else ()))
        if lib is None:
            return rotary_qk_ref(positions, q, k, cos_sin, qk_norm)
        if qk_norm is not None:  # new tensors, as the reference's norm makes them
            q = rms_norm_native(lib, q, qk_norm.q_weight, qk_norm.q_eps, None, qk_norm.unit_offset)
            k = rms_norm_native(lib, k, qk_norm.k_weight, qk_norm.k_eps, None, qk_norm.unit_offset)
        rotary_qk_native(lib, positions, q, k, cos_sin)
        return q, k
    half = rotary_dim // 2
    widest = WIDE_BLOCK_H if num_tokens >= WIDE_FROM_TOKENS else MAX_BLOCK_H
    block_h = min(triton.next_power_of_2(max(num_heads, k.shape[1])), widest)
    has_norm = qk_norm is not None
    q_w, k_w, q_eps, k_eps = qk_norm[:4] if has_norm else (cos_sin, cos_sin, 0.0, 0.0)
    grid = (num_tokens, triton.cdiv(max(num_heads, k.shape[1]), block_h))
    if kv is None:
        cache = (k, 0, 0, k, k, positions, k)  # unused
    else:
        cache = (kv.v, kv.v.stride(0), kv.v.stride(1), kv.kv_cache[0], kv.kv_cache[1], kv.slot_mapping, kv.out)
    out_row = kv.out[0].numel() if kv is not None else 1
    _rotary_qk_kernel[grid](
        positions.contiguous(),
        q,
        q.stride(0),
        q.stride(1),
        num_heads,
        k,
        k.stride(0),
        k.stride(1),
        k.shape[1],
        cos_sin,
        q_w,
        k_w,
        q_eps,
        k_eps,
        head_dim,
        half,
        1.0 / head_dim,
        *cache,
        HAS_NORM=has_norm,
        UNIT_OFFSET=has_norm and qk_norm.unit_offset,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        CACHE=kv is not None,
        KV_FP8=kv is not None and kv.kv_cache.dtype == torch.float8_e4m3fn,
        BLOCK_D=triton.next_power_of_2(head_dim),
        OUT_ROW=out_row,
        BLOCK_OUT=triton.next_power_of_2(out_row),
        **pdl_launch(q.device),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # x1 * cos - x2 * sin with each product rounded, as torch computes it
    )
    return q, k


def _writes_cache(q: torch.Tensor, k: torch.Tensor, kv: KVWrite) -> bool:
    """Whether the kernel can take `kv`'s write: the layout write_kv_triton takes, q's dtype."""
    cache = kv.kv_cache
    return (
        cache.is_contiguous()
        and cache.shape[3:] == k.shape[1:]
        and kv.v.shape == k.shape
        and kv.v.stride(-1) == 1
        and kv.v.dtype == q.dtype
        and (cache.dtype == q.dtype or cache.dtype == torch.float8_e4m3fn)
        and kv.slot_mapping.shape == (k.shape[0],)
        and kv.out.is_contiguous()
        and kv.out.shape[0] == k.shape[0]
    )
