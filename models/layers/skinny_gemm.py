"""Skinny GEMM: y = x @ W^T (+ bias) for the few token rows of a small decode batch.

A decode step of a small batch multiplies a handful of rows by every weight matrix of the
model: the product is bound by reading W once, and each launch moves a few MB. cuBLAS picks
kernels for those shapes that read W at a fraction of the HBM bandwidth (the batch-1 profile of
the Qwen3-0.6B shape: 113 GEMMs of 5-10 us, ~1 TB/s). Here one program owns BLOCK_N output
columns and streams their rows of W once over the whole K, for every x row at once:

- one x row (`BLOCK_M == 1`): W tile [BLOCK_N, BLOCK_K] times the x chunk, accumulated
  elementwise in fp32 and summed over K once at the end (no tensor cores: nothing to reuse);
- 2..`MAX_ROWS` rows: `tl.dot` of the x rows (padded to 16) with the W tile, fp32 accumulation.

No split over K (no atomics): a column's sum runs in one fixed order, so results do not vary
between runs or with CUDA-graph replay, and a row's result depends on the number of rows only
through which of the two paths runs.

`_skinny_gemm_kernel` (Triton) -> `skinny_linear()` (checks, tile choice, dispatch through
`use_triton`) -> `skinny_linear_ref()` (the torch specification: fp32 products and sums, one
rounding to the input dtype). `Linear` takes this path on CUDA for <= `MAX_ROWS` rows of a half
precision input (`wants_skinny`); larger batches stay with cuBLAS.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton, use_triton

MAX_ROWS = 16  # x rows the kernel takes; more go to cuBLAS
ENABLED = True  # benchmarks turn it off to compare with cuBLAS alone (read when a product runs)
_HALF = (torch.float16, torch.bfloat16)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] in x's dtype, computed in fp32."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr,  # [M, K], unit column stride
        x_stride,
        w_ptr,  # [N, K], unit column stride
        w_stride,
        bias_ptr,  # [N] (unused unless HAS_BIAS)
        out_ptr,  # [M, N] contiguous
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,  # 1, or 16 (tl.dot)
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                k_ok = k < K
                w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                xk = tl.load(x_ptr + k, mask=k_ok, other=0.0)
                acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
            y = tl.sum(acc, axis=1)  # [BLOCK_N]
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)
        else:
            rows = tl.arange(0, BLOCK_M)
            row_ok = rows < M
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                k_ok = k < K
                xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
                acc = tl.dot(xk, tl.trans(w), acc)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def skinny_tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, K] x [n, K] product: enough
    programs to cover the GPU's SMs (BLOCK_N down to 8 for one row, 16 for tl.dot)."""
    if m == 1:
        block_n = 16 if n >= 16 * 256 else 8
        return 1, block_n, 512, 4, 3
    return 16, (32 if n >= 32 * 256 else 16), 128, 4, 4


def wants_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `Linear` takes the skinny kernel for this product."""
    return (
        ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in _HALF and weight.dtype == x.dtype
        and HAS_TRITON
    )  # fmt: skip


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tiles: tuple[int, int, int, int, int] | None = None,  # skinny_tiles' choice unless given (benchmarks, tests)
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"the skinny kernel takes 1..{MAX_ROWS} rows, got {m}"
    assert weight.dim() == 2 and weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and (bias is None or bias.shape == (n,)), "x, weight (and bias) of one dtype"
    assert x.dtype in _HALF or not x.is_cuda, "compiled, tl.dot would round fp32 inputs to tf32: half precision only"
    if not use_triton(x.device):
        return skinny_linear_ref(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block_m, block_n, block_k, warps, stages = skinny_tiles(m, n) if tiles is None else tiles
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), out if bias is None else bias, out, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
