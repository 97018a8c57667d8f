"""The gated RMSNorm kernel (Mamba2's output norm) computes its reference, transformers' form.

Guards against: groups normalised together (the mean over the whole row instead of per group),
x and gate swapped, silu applied to x, the normalised row not rounded to the input dtype before
the weight multiplies it (bf16 results would drift from transformers), strided rows (slices of
the in_proj output), a group of a width that is not a power of two losing or reading past its
tail, and large gates overflowing to nan.
"""

from __future__ import annotations

import pytest
import torch

FP32_TOL = 2e-6  # relative: the kernel sums squares in another order than torch's mean
HALF_ULPS = 1  # half precision: one rounding of the normalised row, one of the product
MAX_DIFFER = 0.05  # share of half-precision elements off the reference; a skipped rounding ~25%


def _check_against_reference(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.mamba.gated_norm import gated_rms_norm, gated_rms_norm_ref

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for num_tokens, hidden, group in [(1, 48, 48), (3, 96, 24), (2, 40, 20), (5, 1200, 600), (4, 64, 8)]:
            name = f"{dtype} tokens={num_tokens} hidden={hidden} group={group}"
            wide = torch.randn(num_tokens, 2 * hidden + 5, generator=gen).to(device, dtype)
            x, gate = wide[:, 1 : 1 + hidden], wide[:, 2 + hidden : 2 + 2 * hidden]  # strided rows
            gate[0, :2] = torch.tensor([-90.0, 90.0], dtype=dtype, device=device)  # saturating gates
            # Groups of very different scales: a norm over the whole row would miss it.
            x = x * torch.linspace(0.1, 10.0, hidden // group, device=device, dtype=dtype).repeat_interleave(group)
            weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(device, dtype)
            got = gated_rms_norm(x, gate, weight, group, 1e-5)
            want = gated_rms_norm_ref(x, gate, weight, group, 1e-5)
            assert got.shape == want.shape == (num_tokens, hidden) and got.dtype == want.dtype, name
            assert not got.isnan().any(), f"{name}: nan"
            bound = FP32_TOL * (1 + want.float().abs())
            if dtype != torch.float32:
                bound = bound + HALF_ULPS * torch.finfo(dtype).eps * 2 * want.float().abs()
                differ = float((got != want).float().mean())
                assert differ <= MAX_DIFFER or got.numel() < 1000, f"{name}: {differ:.1%} of elements differ"
            excess = (got.float() - want.float()).abs() - bound
            assert float(excess.max()) <= 0, f"{name}: off by {float(excess.max())} beyond tolerance"
    assert gated_rms_norm(torch.zeros(0, 8, device=device), torch.zeros(0, 8, device=device), torch.ones(8, device=device), 4, 1e-5).shape == (0, 8)


def test_gated_norm_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_against_reference)


def test_gated_norm_module_on_cpu_is_the_reference():
    """Without Triton (a plain CPU run) the module computes transformers' form exactly."""
    from slotrunner.models.layers.mamba.gated_norm import GatedRMSNorm, gated_rms_norm_ref

    norm = GatedRMSNorm(32, 8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x, gate = torch.randn(3, 32), torch.randn(3, 32)
    torch.testing.assert_close(norm(x, gate), gated_rms_norm_ref(x, gate, norm.weight, 8, 1e-6), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gated_norm_kernel_matches_reference_gpu():
    _check_against_reference("cuda", (torch.float32, torch.float16, torch.bfloat16))
