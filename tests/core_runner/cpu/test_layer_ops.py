"""The native per-layer ops (`layer_ops.c`) against their torch references, on awkward sizes.

Guards against: a rotation that fuses products into fma or reads the wrong position, head or
stride (q and k are strided views of the fused qkv output), partial rotary touching the
pass-through channels, an RMSNorm that reads the residual before rounding the sum, drops Gemma's
(1 + w), or depends on the batch; and against the dispatch sending what the native code does not
cover (half precision, tensors that need gradients) anywhere but the reference.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.core_runner.cpu.native import native_unavailable_reason
from slotrunner.models.layers.norm import rms_norm, rms_norm_ref
from slotrunner.models.layers.rotary_qk import QKNorm, rotary_qk, rotary_qk_ref

pytestmark = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))


def _cos_sin(max_position: int, rotary_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(3, 1, 10, 10), (5, 5, 12, 6), (4, 2, 64, 64)])
@pytest.mark.parametrize("norm", [None, "plain", "unit_offset"])
def test_rotary_is_the_reference_bit_for_bit(heads, kv_heads, head_dim, rotary_dim, norm):
    g = torch.Generator().manual_seed(heads * head_dim)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided views, as in attention
    positions = torch.tensor([0, 5, 1, 30, 2, 2, 17])
    cos_sin = _cos_sin(32, rotary_dim)
    qk_norm = None
    if norm is not None:
        qk_norm = QKNorm(torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g), 1e-6, 1e-5, norm == "unit_offset")
    ref_q, ref_k = rotary_qk_ref(positions, q.clone(), k.clone(), cos_sin, qk_norm)
    out_q, out_k = rotary_qk(positions, q, k, cos_sin, qk_norm)
    if qk_norm is None:
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    else:  # the per-head norm sums in its own order: float32 rounding of the reference
        torch.testing.assert_close(out_q, ref_q, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out_k, ref_k, rtol=2e-6, atol=2e-6)
    if rotary_dim < head_dim and qk_norm is None:
        assert torch.equal(out_q[..., rotary_dim:], ref_q[..., rotary_dim:])


@pytest.mark.parametrize("hidden", [1, 7, 8, 37, 576])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_the_reference_and_the_batch_does_not_matter(hidden, unit_offset):
    g = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(5, hidden, generator=g) * 3, torch.randn(5, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    out, res = rms_norm(x, weight, 1e-6, residual, unit_offset)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-6, residual, unit_offset)
    assert torch.equal(res, ref_res), "x + residual is one rounded add, as in the reference"
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    for i in range(5):
        alone = rms_norm(x[i : i + 1], weight, 1e-6, residual[i : i + 1], unit_offset)[0]
        assert torch.equal(alone[0], out[i]), "a row's result depends on its batch"
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm(x.t().contiguous().t(), weight, 1e-6))


def test_rms_norm_of_a_strided_view_reads_its_rows():
    base = torch.randn(4, 20)
    view = base[:, 2:18]  # row stride 20, 16 channels
    torch.testing.assert_close(rms_norm(view, torch.ones(16), 1e-5), rms_norm_ref(view, torch.ones(16), 1e-5), rtol=2e-6, atol=2e-6)


def test_what_the_native_code_does_not_cover_takes_the_reference():
    x, weight = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    w = torch.randn(16, requires_grad=True)
    y = rms_norm(torch.randn(3, 16), w, 1e-6)
    assert y.grad_fn is not None, "a tensor that needs gradients goes through torch"


def test_kv_write_is_the_reference_and_declines_what_it_does_not_cover():
    """K and V are strided views of the fused qkv output; slots land anywhere in the cache. A
    float8 cache (bytes, not floats) or a non-contiguous one goes back to the reference."""
    from slotrunner.core_runner.attention.backend import write_kv
    from slotrunner.core_runner.cpu.layer_ops import write_kv_native
    from slotrunner.core_runner.cpu.native import load_library

    lib = load_library()
    qkv = torch.randn(5, 7 * 12 + 2 * 3 * 12)
    _, k, v = qkv.split([7 * 12, 3 * 12, 3 * 12], dim=-1)
    k, v = k.view(5, 3, 12), v.view(5, 3, 12)
    slots = torch.tensor([0, 17, 63, 5, 40])
    want, got = torch.randn(2, 4, 16, 3, 12), torch.zeros(2, 4, 16, 3, 12)
    got.copy_(want)
    write_kv(want, k, v, slots)
    assert write_kv_native(lib, got, k, v, slots)
    assert torch.equal(got, want)
    fp8 = torch.zeros(2, 4, 16, 3, 12, dtype=torch.float8_e4m3fn)
    assert not write_kv_native(lib, fp8, k, v, slots)
    strided = torch.zeros(2, 4, 16, 3, 24)[..., :12]
    assert not write_kv_native(lib, strided, k, v, slots)
    assert not strided.any() and not fp8.float().any()
