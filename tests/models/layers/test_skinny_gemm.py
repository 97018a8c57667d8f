"""The skinny GEMM kernel (decode batches of <= 16 rows) computes its reference.

Guards against: a K tail past the last whole tile (K = 1030 with 512-key tiles) or an N tail
past the last column block being dropped or read out of bounds, rows leaking into each other or
into the padding rows past M (M = 3, 5), strided x rows (a slice of a wider buffer), the bias
added to the wrong columns or not at all, a row's result depending on how many rows came with
it (it must be bitwise the same alone), `Linear` taking the kernel where it must not (CPU
tensors, fp32, more than LINEAR_MAX_ROWS rows); with the gated activation in the same launch:
gate and up swapped or offset, act(gate) or the product not rounded where the activation's own
kernel rounds (the fused launch must equal that kernel followed by the plain one, bitwise); with
the residual add and RMSNorm in the same launch: a row's 1 / rms taken from a chunk instead of
the whole row (K = 1030 spans three chunks), the new residual not stored or stored for padding
rows, Gemma's 1 + w scale, the norm rounded elsewhere than norm.py's kernel rounds (bitwise again, interpreted).
"""

from __future__ import annotations

import pytest
import torch

SHAPES = [(1, 7, 5), (1, 40, 1030), (3, 300, 600), (8, 33, 2100), (5, 16, 64)]


def _check(device: str = "cpu", dtypes=(torch.float32, torch.float16)) -> None:
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.skinny_gemm import skinny_linear, skinny_linear_ref

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for m, n, k in SHAPES:
            wide = torch.randn(m, k + 3, generator=gen).to(device, dtype)
            x = wide[:, 2 : 2 + k]  # strided rows
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
            bias = torch.randn(n, generator=gen).to(device, dtype) if n % 2 else None
            got, want = skinny_linear(x, w, bias), skinny_linear_ref(x, w, bias)
            assert got.shape == (m, n) and got.dtype == dtype, (m, n, k, dtype)
            # Only the order of the fp32 sums differs: one rounding apart in the output dtype.
            tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            err = float(((got.float() - want.float()).abs() - tol * (1 + want.float().abs())).max())
            assert err <= 0, f"m={m} n={n} k={k} {dtype}: off by {err} beyond tolerance"
            # Batch invariance: each row alone gives bitwise its result in the batch.
            for r in range(m):
                assert torch.equal(skinny_linear(x[r : r + 1], w, bias), got[r : r + 1]), f"row {r} of {m} differs alone"


def _check_gated(device: str = "cpu", dtypes=(torch.float32, torch.float16)) -> None:
    from slotrunner.models.layers.activation import gated_act
    from slotrunner.models.layers.skinny_gemm import skinny_linear, skinny_linear_ref

    gen = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for act in ("silu", "gelu", "gelu_pytorch_tanh"):
            for m, n, k in [(1, 40, 1030), (2, 9, 96), (5, 33, 2100)]:
                h = (2 * torch.randn(m, 2 * k, generator=gen)).to(device, dtype)
                w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
                bias = torch.randn(n, generator=gen).to(device, dtype) if m == 2 else None
                got = skinny_linear(h, w, bias, act=act)
                assert torch.equal(got, skinny_linear(gated_act(h, act), w, bias)), f"{act} m={m} {dtype}: fused differs"
                want = skinny_linear_ref(h, w, bias, act=act)
                tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
                err = float(((got.float() - want.float()).abs() - tol * (1 + want.float().abs())).max())
                assert err <= 0, f"{act} m={m} n={n} k={k} {dtype}: off by {err} beyond tolerance"


def _check_normed(device: str = "cpu", dtypes=(torch.float32, torch.float16), bitwise: bool = True) -> None:
    from slotrunner.models.layers.norm import rms_norm, rms_norm_ref
    from slotrunner.models.layers.skinny_gemm import skinny_linear, skinny_linear_ref, skinny_norm_linear

    gen = torch.Generator().manual_seed(2)
    for dtype in dtypes:
        for unit_offset in (False, True):
            for m, n, k in [(1, 40, 1030), (2, 9, 96), (3, 33, 300)]:
                x = (2 * torch.randn(m, k, generator=gen)).to(device, dtype)
                res = torch.randn(m, k, generator=gen).to(device, dtype)
                nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, dtype)
                w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
                bias = torch.randn(n, generator=gen).to(device, dtype) if m == 2 else None
                name = f"m={m} n={n} k={k} {dtype} unit_offset={unit_offset}"
                got, got_res = skinny_norm_linear(x, res, nw, 1e-6, unit_offset, w, bias)
                normed, want_res = rms_norm_ref(x, nw, 1e-6, res, unit_offset)
                assert torch.equal(got_res, want_res), f"{name}: x + residual differs"
                want = skinny_linear_ref(normed, w, bias)
                tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
                err = float(((got.float() - want.float()).abs() - tol * (1 + want.float().abs())).max())
                assert err <= 0, f"{name}: off by {err} beyond tolerance"
                # fp32 on a CPU takes the native norm, not norm.py's kernel; compiled, the norm kernel
                # may reduce a row over another number of warps than the GEMM's (1 / rms a bit off).
                if dtype != torch.float32 and bitwise:
                    kernel_normed, _ = rms_norm(x, nw, 1e-6, res, unit_offset)
                    assert torch.equal(got, skinny_linear(kernel_normed, w, bias)), f"{name}: fused differs"


def _interpreted():
    _check()
    _check_gated()
    _check_normed()


def test_kernel_matches_reference_interpreted(run_interpreted):
    run_interpreted(_interpreted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_compiled():
    _check("cuda", (torch.float16, torch.bfloat16))
    _check_gated("cuda", (torch.float16, torch.bfloat16))
    _check_normed("cuda", (torch.float16, torch.bfloat16), bitwise=False)


def test_linear_takes_the_kernel_only_where_it_should():
    from slotrunner.models.layers.skinny_gemm import LINEAR_MAX_ROWS, wants_skinny

    w = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert not wants_skinny(torch.zeros(1, 4, dtype=torch.bfloat16), w), "CPU tensors stay with torch"
    if torch.cuda.is_available():
        wc = w.cuda()
        assert wants_skinny(torch.zeros(LINEAR_MAX_ROWS, 4, dtype=torch.bfloat16, device="cuda"), wc)
        assert not wants_skinny(torch.zeros(LINEAR_MAX_ROWS + 1, 4, dtype=torch.bfloat16, device="cuda"), wc)
        assert not wants_skinny(torch.zeros(1, 4, device="cuda"), wc.float()), "fp32 stays with cuBLAS"


@pytest.mark.parametrize("k", [1024, 3072])
def test_dependent_launch_compiles(compile_for_hopper, k):
    """Compiled for sm_90 as a Hopper launches it (programmatic dependent launch): one wait, no spill."""
    pytest.importorskip("triton")
    from slotrunner.models.layers import skinny_gemm

    signature = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*bf16", w_stride="i32", bias_ptr="*bf16", out_ptr="*bf16",
                     res_ptr="*bf16", res_stride="i32", norm_w_ptr="*bf16", res_out_ptr="*bf16", M="i32", N="i32", K="i32",
                     inv_k="fp32", eps="fp32")  # fmt: skip
    block_n, block_k, warps, stages = skinny_gemm.skinny_tiles(k)
    constexprs = dict(HAS_BIAS=False, NORM=1, BLOCK_H=1 << (k - 1).bit_length(), ACT=-1, LIBDEVICE=True, ROWS=1, BLOCK_N=block_n, BLOCK_K=block_k,
                      PDL=True)  # fmt: skip
    usage = compile_for_hopper(skinny_gemm._skinny_gemm_kernel, signature, constexprs, num_warps=warps, num_stages=stages)
    assert "LOCAL:0" in usage and "GDC_WAITS:1" in usage, usage
