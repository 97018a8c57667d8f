"""Skinny GEMM: y = x @ W^T (+ bias) for the few token rows of a small decode batch.

A decode step of a small batch multiplies a handful of rows by every weight matrix of the
model: the product is bound by reading W once, and each launch moves a few MB. cuBLAS picks
kernels for those shapes that read W at a fraction of the HBM bandwidth (the batch-1 profile of
the Qwen3-0.6B shape: 112 GEMMs of 5-13 us, down to 0.3 TB/s). Here one program owns BLOCK_N
output columns and streams their rows of W once over the whole K: each [BLOCK_N, BLOCK_K] tile
of W, loaded once, is multiplied by the K chunk of every x row and summed over the chunk, in
fp32 (no tensor cores: with <= 8 rows there is nothing to reuse).

No split over K (no atomics) and tiles that depend on K alone: a column's sum runs in one fixed
order, the same for every row count up to `MAX_ROWS`, so results do not vary between runs, with
CUDA-graph replay, or with the batch (a batch-1 decode and a batch-1 verification of drafts
compute a row's products bitwise alike).

`_skinny_gemm_kernel` (Triton) -> `skinny_linear()` (checks, tile choice, dispatch through
`use_triton`) -> `skinny_linear_ref()` (the torch specification: fp32 products and sums, one
rounding to the input dtype). `Linear` takes this path on CUDA for <= `LINEAR_MAX_ROWS` rows of
a half precision input (`wants_skinny`); larger batches stay with cuBLAS.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, TRITON_INTERPRET, tl, triton, use_triton
from slotrunner.models.layers.activation import gated_act_ref, kernel_act

if HAS_TRITON:
    from slotrunner.models.layers.activation import gated_value

MAX_ROWS = 8  # x rows the kernel takes
# Rows up to which `Linear` takes the kernel. On one H200 (benchmarks/skinny_gemm.py, the
# Qwen3-0.6B shape's four products) it beats cuBLAS by 1.15-3.2x at one row and by 0.9-1.6x at
# two (7% in sum), and loses from four rows on: each extra row adds a reduction per K chunk.
LINEAR_MAX_ROWS = 2
ENABLED = True  # benchmarks turn it off to compare with cuBLAS alone (read when a product runs)
_HALF = (torch.float16, torch.bfloat16)


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] in x's dtype, computed in fp32; with `act`, x is
    [M, 2K] = [gate | up] and the product is over gated_act(x) (rounded as that layer rounds)."""
    if act is not None:
        x = gated_act_ref(x, act)
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
        ACT: tl.constexpr,  # -1: x is the input; else x is [gate | up] (2K wide), input act(gate) * up
        LIBDEVICE: tl.constexpr,  # compiled: CUDA's exp/tanh (activation.gated_value)
        ROWS: tl.constexpr,  # power of two >= M
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        row_ids = tl.arange(0, ROWS)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            # Each x row against the W tile loaded once: its partial sums over this K chunk, in
            # the same order whatever ROWS is (a row's result does not depend on the batch).
            for r in tl.static_range(ROWS):
                # Padding rows (r >= M) read row M - 1 again; their sums are never stored.
                x_row = x_ptr + tl.minimum(r, M - 1) * x_stride
                xr = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
                if ACT >= 0:  # the gated activation's output, rounded as its own kernel stores it
                    up = tl.load(x_row + K + k, mask=k_ok, other=0.0).to(tl.float32)
                    xr = gated_value(xr, up, ACT, LIBDEVICE, x_ptr.dtype.element_ty)
                    xr = xr.to(x_ptr.dtype.element_ty).to(tl.float32)
                part = tl.sum(w * xr[None, :], axis=1)  # [BLOCK_N]
                acc += tl.where(row_ids[:, None] == r, part[None, :], 0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + row_ids.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(row_ids < M)[:, None] & col_ok[None, :])


def skinny_tiles(k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a product over K inputs: the fastest of a
    sweep on one H200 at the Qwen3-0.6B shape's products (benchmarks/skinny_gemm.py). They
    depend on K alone, never on the row count, so a row's sums run in one order at any M."""
    if k >= 2048:
        return 8, 1024, 8, 4
    return 8, 512, 4, 3


def wants_skinny(x: torch.Tensor, weight: torch.Tensor, act: str | None = None) -> bool:
    """Whether `Linear` takes the skinny kernel for this product (with `act`: over the gated
    activation of x = [gate | up], in the same launch)."""
    return (
        ENABLED and HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] <= LINEAR_MAX_ROWS
        and x.dtype in _HALF and weight.dtype == x.dtype and (act is None or kernel_act(act) is not None)
    )  # fmt: skip


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tiles: tuple[int, int, int, int] | None = None,  # skinny_tiles' choice unless given (benchmarks, tests)
    act: str | None = None,  # x is [M, 2K] = [gate | up]: the product of W with act(gate) * up
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape[0], x.shape[1] // (1 if act is None else 2)
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"the skinny kernel takes 1..{MAX_ROWS} rows, got {m}"
    assert weight.dim() == 2 and weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and (bias is None or bias.shape == (n,)), "x, weight (and bias) of one dtype"
    code = -1 if act is None else kernel_act(act)
    assert code is not None, f"the kernels lack activation {act!r}"
    if not use_triton(x.device):
        return skinny_linear_ref(x, weight, bias, act)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block_n, block_k, warps, stages = skinny_tiles(k) if tiles is None else tiles
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), out if bias is None else bias, out, m, n, k,
        HAS_BIAS=bias is not None, ACT=code, LIBDEVICE=not TRITON_INTERPRET, ROWS=triton.next_power_of_2(m),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        enable_fp_fusion=False,  # no fma: each product rounded, as the activation's own kernel does
    )  # fmt: skip
    return out
