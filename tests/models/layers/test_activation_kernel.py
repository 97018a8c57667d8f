"""The gated-activation kernel (silu, gelu, gelu-tanh of gate, times up) computes its reference.

Guards against: gate and up halves swapped or offset, a width past one block (1025) losing its
tail, strided rows (a slice of a wider buffer), act(gate) not rounded to the input dtype before
the product (bf16 results would drift from transformers), overflow to nan for large |gate|
(exp(-x) and tanh of large arguments), 3-D inputs.
"""

from __future__ import annotations

import pytest
import torch

ACTS = ("silu", "gelu", "gelu_pytorch_tanh")
# |got - want| <= FP32_TOL * (1 + |gate * up|): act(g) computed in fp32 may be ulps of |g| off,
# which is a large relative error where 1 + erf or 1 + tanh cancels (gelu of negative gates);
# the product scales it by |up|. The interpreter's exp/erf (numpy) are not torch's.
FP32_TOL = 1e-6
# Half precision adds two roundings: act(g) to the dtype (one ulp of act there can be two ulps
# of the product) and the product itself.
HALF_ULPS = 2
MAX_DIFFER = 0.05  # share of half-precision elements off the reference; a skipped rounding ~25%


def _check_against_reference(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.activation import gated_act, gated_act_ref

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for act in ACTS:
            for num_tokens, d in [(1, 40), (3, 1), (2, 1025), (16, 96)]:
                name = f"{dtype} {act} tokens={num_tokens} d={d}"
                wide = (torch.randn(num_tokens, 2 * d + 3, generator=gen) * 3).to(device, dtype)
                x = wide[:, 1 : 1 + 2 * d]  # strided rows
                if d >= 40:
                    x[0, :4] = torch.tensor([-90.0, 90.0, -12.0, 12.0], dtype=dtype, device=device)  # saturating gates
                got, want = gated_act(x, act), gated_act_ref(x, act)
                assert got.shape == want.shape == (num_tokens, d) and got.dtype == want.dtype, name
                assert not got.isnan().any(), f"{name}: nan"
                gate, up = x.float().chunk(2, dim=-1)
                bound = FP32_TOL * (1 + (gate * up).abs())
                if dtype != torch.float32:
                    bound = bound + HALF_ULPS * torch.finfo(dtype).eps * want.float().abs()
                    differ = float((got != want).float().mean())
                    assert differ <= MAX_DIFFER or got.numel() < 1000, f"{name}: {differ:.1%} of elements differ"
                excess = (got.float() - want.float()).abs() - bound
                assert float(excess.max()) <= 0, f"{name}: off by {float(excess.max())} beyond tolerance"
        x = torch.randn(2, 3, 2 * 24, generator=gen).to(device, dtype)
        got, want = gated_act(x, "silu"), gated_act_ref(x, "silu")
        assert got.shape == (2, 3, 24)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-3)
    assert gated_act(torch.zeros(0, 8, device=device), "silu").shape == (0, 4)


def test_gated_act_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_against_reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_gated_act_matches_reference():
    _check_against_reference("cuda", (torch.float32, torch.float16, torch.bfloat16))
