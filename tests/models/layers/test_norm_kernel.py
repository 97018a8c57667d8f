"""The fused RMSNorm kernel (with and without the residual add) computes its torch reference.

Guards against: a hidden size that is not a power of two reading past the row (80, 576), a
strided row (a column slice of a wider buffer) read as if contiguous, the residual sum not
rounded to the input dtype before the norm reads it, the normalized row not rounded before the
weight multiplies it (bf16 results would then drift from transformers), inputs written in place
(the first layer's residual is the caller's embedding buffer), 3-D inputs (per-head norms), and
Gemma's unit-offset form (scale 1 + w in fp32, one rounding, the input's dtype out) computed
with Llama's roundings or dtype.
"""

from __future__ import annotations

import pytest
import torch

FP32_TOL = dict(atol=1e-6, rtol=1e-6)
# Half precision: the kernel sums the squares in another order, which now and then moves the
# rounded h = x * rsqrt(...) by one ulp; weight * h then moves by one or two ulps of the output.
MAX_ULPS = 2
EPS = 1e-6


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between fp16/bf16 tensors (+0 and -0 are equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def _assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{what}: {m}")
    else:
        ulps = int(_ulps(got, want).max())
        assert ulps <= MAX_ULPS, f"{what}: {ulps} ulps apart"


def _check_against_reference(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.norm import rms_norm, rms_norm_ref

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for num_tokens, hidden in [(1, 80), (3, 576), (2, 64), (4, 7)]:
            name = f"{dtype} tokens={num_tokens} hidden={hidden}"
            wide = (torch.randn(num_tokens, hidden + 5, generator=gen) * 3).to(device, dtype)
            x = wide[:, 2 : 2 + hidden]  # strided rows, as a slice of a wider buffer
            residual = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
            weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(device, dtype)
            before = (x.clone(), residual.clone())

            for unit_offset in (False, True):
                tag = f"{name} unit_offset={unit_offset}"
                want = rms_norm_ref(x, weight, EPS, unit_offset=unit_offset)
                _assert_matches(rms_norm(x, weight, EPS, unit_offset=unit_offset), want, f"{tag} plain")
                out, new_res = rms_norm(x, weight, EPS, residual, unit_offset)
                want_out, want_res = rms_norm_ref(x, weight, EPS, residual, unit_offset)
                assert torch.equal(new_res, want_res), f"{tag}: x + residual is not the dtype's rounded sum"
                _assert_matches(out, want_out, f"{tag} with residual")
            assert torch.equal(x, before[0]) and torch.equal(residual, before[1]), f"{name}: inputs were written"

        # Per-head norm of a [tokens, heads, head_dim] view (Qwen3's q_norm outside the fused path);
        # an fp32 weight on half inputs promotes the output to fp32, as `weight * h.to(dtype)` does.
        qkv = torch.randn(3, 4 * 16 + 8, generator=gen).to(device, dtype)
        q = qkv[:, : 4 * 16].view(3, 4, 16)
        for weight in (torch.randn(16, generator=gen).to(device, dtype), torch.randn(16, generator=gen).to(device)):
            _assert_matches(rms_norm(q, weight, EPS), rms_norm_ref(q, weight, EPS), f"{dtype} per-head, weight {weight.dtype}")
            # Gemma's form keeps the input's dtype whatever the weight's.
            got = rms_norm(q, weight, EPS, unit_offset=True)
            assert got.dtype == dtype, f"{dtype} unit_offset with weight {weight.dtype}: output {got.dtype}"
            _assert_matches(got, rms_norm_ref(q, weight, EPS, unit_offset=True), f"{dtype} per-head unit_offset")

    empty = rms_norm(torch.zeros(0, 8, device=device), torch.ones(8, device=device), EPS, torch.zeros(0, 8, device=device))
    assert empty[0].shape == empty[1].shape == (0, 8)


def test_rms_norm_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_against_reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_rms_norm_matches_reference():
    """bf16 included: the reference's roundings are reproduced, so at most one ulp apart."""
    _check_against_reference("cuda", (torch.float32, torch.float16, torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_rms_norm_bf16_mostly_bitwise():
    """Beyond one ulp, how often: a kernel that rounds at other points than the reference differs
    in a large fraction of elements, one that only sums in another order in very few."""
    from slotrunner.models.layers.norm import rms_norm, rms_norm_ref

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(1024, generator=gen)).to("cuda", torch.bfloat16)
    out, _ = rms_norm(x, weight, EPS, residual)
    want, _ = rms_norm_ref(x, weight, EPS, residual)
    differ = float((_ulps(out, want) > 0).float().mean())
    assert differ < 0.01, f"{differ:.2%} of elements differ from the reference"
