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
CUDA-graph replay, or with the number of rows the kernel is given (`Linear` gives it 1-2 rows;
more go to cuBLAS, whose sums run in another order).

The launch also takes what feeds the product where that is one small kernel of its own: the
gated activation of an MLP's [gate | up] (`act`, the down projection's input: activation.py's
`gated_value`) or the residual add and RMSNorm before a layer's first product
(`skinny_norm_linear`: each program recomputes its rows' 1 / rms from the whole row, program 0
stores x + residual). Both round where their own kernels round, so a fused launch equals those
kernels followed by the plain product (tested bitwise; compiled, a row's 1 / rms may differ in
the last bit where the norm kernel reduces the row over another number of warps).

`_skinny_gemm_kernel` (Triton) -> `skinny_linear()` / `skinny_norm_linear()` (checks, tile
choice, dispatch through `use_triton`) -> `skinny_linear_ref()` (the torch specification: fp32
products and sums, one rounding to the input dtype). `Linear` takes this path on CUDA for
<= `LINEAR_MAX_ROWS` rows of a half precision input (`wants_skinny`); larger batches stay with
cuBLAS.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, TRITON_INTERPRET, jit_per_step, pdl_launch, tl, triton, use_triton
from slotrunner.models.layers.activation import gated_act_ref, kernel_act
from slotrunner.models.layers.norm import rms_norm_ref

if HAS_TRITON:
    from slotrunner.core_runner.triton_utils import pdl_enter
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

    @jit_per_step()
    def _skinny_gemm_kernel(
        x_ptr,  # [M, K], unit column stride
        x_stride,
        w_ptr,  # [N, K], unit column stride
        w_stride,
        bias_ptr,  # [N] (unused unless HAS_BIAS)
        out_ptr,  # [M, N] contiguous
        res_ptr,  # [M, K] the residual stream, unit column stride (unused unless NORM)
        res_stride,
        norm_w_ptr,  # [K] the RMSNorm's weight (unused unless NORM)
        res_out_ptr,  # [M, K] contiguous: x + residual, written by program 0 (unused unless NORM)
        M,
        N,
        K,
        inv_k,  # 1 / K as the RMSNorm kernel takes it
        eps,
        HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr,  # 0: x is the input; 1: rms_norm(x, residual) is; 2: the same, Gemma's 1 + w scale
        BLOCK_H: tl.constexpr,  # power of two >= K (NORM: the whole row in one block, as the norm kernel)
        ACT: tl.constexpr,  # -1: x is the input; else x is [gate | up] (2K wide), input act(gate) * up
        LIBDEVICE: tl.constexpr,  # compiled: CUDA's exp/tanh (activation.gated_value)
        ROWS: tl.constexpr,  # power of two >= M
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,  # triton_utils.pdl_launch
    ):
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        row_ids = tl.arange(0, ROWS)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
        pdl_enter(PDL)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        rstd = tl.zeros((ROWS,), dtype=tl.float32)
        if NORM > 0:  # norm.py's _rms_norm_kernel, row by row: the residual sum and each row's 1 / rms
            hs = tl.arange(0, BLOCK_H)
            # (Names apart from the K loop's: compiled, a name keeps one shape through the loop.)
            for r in tl.static_range(ROWS):
                rr = tl.minimum(r, M - 1)
                row_x = tl.load(x_ptr + rr * x_stride + hs, mask=hs < K, other=0.0)
                row_res = tl.load(res_ptr + rr * res_stride + hs, mask=hs < K, other=0.0)
                row_x = (row_x.to(tl.float32) + row_res.to(tl.float32)).to(x_ptr.dtype.element_ty)
                writer = (pid == 0) & (r < M)  # one program stores the new residual
                tl.store(res_out_ptr + rr * K + hs, row_x, mask=hs < tl.where(writer, K, 0))
                row_h = row_x.to(tl.float32)
                rstd = tl.where(row_ids == r, tl.math.rsqrt(tl.sum(row_h * row_h, axis=0) * inv_k + eps), rstd)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            # Each x row against the W tile loaded once: its partial sums over this K chunk, in
            # the same order whatever ROWS is (a row's result does not depend on the batch).
            if NORM > 0:  # the norm's weight over this chunk, for every row
                wn = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            for r in tl.static_range(ROWS):
                # Padding rows (r >= M) read row M - 1 again; their sums are never stored.
                x_row = x_ptr + tl.minimum(r, M - 1) * x_stride
                xr = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
                if NORM > 0:  # this chunk of rms_norm(x, residual), rounded where the norm kernel rounds
                    rv = tl.load(res_ptr + tl.minimum(r, M - 1) * res_stride + k, mask=k_ok, other=0.0)
                    h = (xr + rv.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
                    h = h * tl.sum(tl.where(row_ids == r, rstd, 0.0), axis=0)
                    if NORM == 2:
                        xr = (h * (1.0 + wn)).to(x_ptr.dtype.element_ty).to(tl.float32)
                    else:
                        xr = h.to(x_ptr.dtype.element_ty).to(tl.float32) * wn
                        xr = xr.to(x_ptr.dtype.element_ty).to(tl.float32)
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


def wants_skinny(
    x: torch.Tensor, weight: torch.Tensor, act: str | None = None, max_rows: int | None = None
) -> bool:
    """Whether `Linear` takes the skinny kernel for this product (with `act`: over the gated
    activation of x = [gate | up]; in the same launch), for at most `max_rows` rows (default
    LINEAR_MAX_ROWS, read at each call: a benchmark may set it)."""
    return (
        ENABLED and HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] <= (LINEAR_MAX_ROWS if max_rows is None else max_rows)
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
    code = -1 if act is None else kernel_act(act)
    assert code is not None, f"the kernels lack activation {act!r}"
    _check(x, weight, bias, m, k)
    if not use_triton(x.device):
        return skinny_linear_ref(x, weight, bias, act)
    return _launch(x, weight, bias, tiles, code, m, k)


def skinny_norm_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    residual: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    unit_offset: bool,  # Gemma's RMSNorm (norm.py)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, N], x + residual [M, K])
    """The product of W with rms_norm(x, residual) (norm.py's fused residual form), the norm in
    the same launch: each program recomputes the rows' 1 / rms, program 0 stores x + residual."""
    m, k = x.shape
    _check(x, weight, bias, m, k)
    assert residual.shape == x.shape and residual.dtype == x.dtype and norm_weight.shape == (k,), "norm inputs"
    assert norm_weight.dtype == x.dtype, "the norm's output keeps x's dtype"
    if not use_triton(x.device):
        normed, res_out = rms_norm_ref(x, norm_weight, eps, residual, unit_offset)
        return skinny_linear_ref(normed, weight, bias), res_out
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    norm = (residual, norm_weight, res_out, eps, 2 if unit_offset else 1)
    return _launch(x, weight, bias, None, -1, m, k, norm), res_out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int, k: int) -> None:
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"the skinny kernel takes 1..{MAX_ROWS} rows, got {m}"
    assert weight.dim() == 2 and weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and (bias is None or bias.shape == (n,)), "x, weight (and bias) of one dtype"


def _launch(x, weight, bias, tiles, code: int, m: int, k: int, norm: tuple | None = None) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n = weight.shape[0]
    block_n, block_k, warps, stages = skinny_tiles(k) if tiles is None else tiles
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    residual, norm_weight, res_out, eps, norm_code = (x, x, x, 0.0, 0) if norm is None else norm
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), out if bias is None else bias, out,
        residual, residual.stride(0), norm_weight, res_out, m, n, k, 1.0 / k, eps,
        HAS_BIAS=bias is not None, NORM=norm_code, BLOCK_H=triton.next_power_of_2(k) if norm_code else 16, ACT=code,
        LIBDEVICE=not TRITON_INTERPRET, ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
        enable_fp_fusion=False,  # no fma: each product rounded, as the norm's and activation's own kernels do
        **pdl_launch(x.device),
    )  # fmt: skip
    return out
