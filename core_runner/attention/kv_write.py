"""The paged K/V cache write as a Triton kernel, and `KVWrite`: one layer's write of a step, which
the Triton attention backend does itself or hands to the layer's rotary launch (`backend.Rotate`).

`_write_kv_kernel` -> `write_kv_triton()`: one program per token stores its K/V at its flat cache
slot (specification: backend.write_kv). Slot -1 marks a padding token of a CUDA-graph batch:
nothing is written, and its output row is zeroed so that stale memory never flows on as NaN.
Over a float8 cache the values are rounded as backend.to_cache_dtype rounds (float8.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, pdl_launch, tl, triton

if HAS_TRITON:
    from slotrunner.core_runner.attention.float8 import round_to_e4m3
    from slotrunner.core_runner.triton_utils import pdl_enter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # of q, k and v
CACHE_DTYPES = (*DTYPES, torch.float8_e4m3fn)  # float8: kv_cache_dtype="fp8"


if HAS_TRITON:

    @triton.jit
    def store_to_cache(ptrs, x, mask, KV_FP8: tl.constexpr):
        """x into the K/V cache at `ptrs`: over a float8 cache rounded first as
        backend.to_cache_dtype rounds (every Triton K/V writer stores through this)."""
        if KV_FP8:
            x = round_to_e4m3(x.to(tl.float32))
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_kv_kernel(
        k_ptr,  # [num_tokens, num_kv_heads, head_dim]
        stride_kt,
        stride_kh,
        v_ptr,  # [num_tokens, num_kv_heads, head_dim]
        stride_vt,
        stride_vh,
        k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
        slot_mapping_ptr,  # [num_tokens] int64, -1 = padding token
        out_ptr,  # [num_tokens, out_row] contiguous, zeroed at padding tokens (when ZERO_OUT)
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        OUT_ROW: tl.constexpr,
        BLOCK_OUT: tl.constexpr,
        ZERO_OUT: tl.constexpr,
        KV_FP8: tl.constexpr,  # float8 e4m3 cache: round as backend.to_cache_dtype does
        PDL: tl.constexpr = False,  # triton_utils.pdl_launch
    ):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:
            if ZERO_OUT:
                offs = tl.arange(0, BLOCK_OUT)
                zeros = tl.zeros([BLOCK_OUT], out_ptr.dtype.element_ty)
                tl.store(out_ptr + t * OUT_ROW + offs, zeros, mask=offs < OUT_ROW)
            return
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        store_to_cache(k_cache_ptr + dst, k, mask, KV_FP8)
        store_to_cache(v_cache_ptr + dst, v, mask, KV_FP8)


class KVWrite(NamedTuple):
    """One layer's K/V write of a step, as `write_kv_triton` takes it: what TritonBackend hands a
    layer's `rotate` hook, whose launch writes the rotated K and V with the rotation's own stores
    (or calls `write`)."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding token
    out: torch.Tensor  # [num_tokens, num_heads, head_dim] the attention's output, zeroed at padding tokens

    def write(self, k: torch.Tensor) -> None:
        write_kv_triton(self.kv_cache, k, self.v, self.slot_mapping, self.out)


def write_kv_triton(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token (not written)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] contiguous, zeroed at padding tokens
) -> None:
    """`write_kv` as one Triton program per token (specification: backend.write_kv)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    assert kv_cache.is_contiguous(), "the paged KV cache must be contiguous"
    assert kv_cache.dtype in CACHE_DTYPES, f"KV cache dtype {kv_cache.dtype}"
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous in head_dim"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens"
    if out is not None:
        assert out.is_contiguous() and out.shape[0] == num_tokens, f"out {tuple(out.shape)}"
    if num_tokens == 0:
        return
    out_row = out[0].numel() if out is not None else 1
    _write_kv_kernel[(num_tokens,)](
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        out if out is not None else k,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        OUT_ROW=out_row,
        BLOCK_OUT=triton.next_power_of_2(out_row),
        ZERO_OUT=out is not None,
        KV_FP8=kv_cache.dtype == torch.float8_e4m3fn,
        **pdl_launch(k.device),
    )
