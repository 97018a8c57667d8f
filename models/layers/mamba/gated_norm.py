"""Gated RMSNorm with groups: the Mamba2 mixer's output norm (`norm_before_gate=False`).

`_gated_rms_norm_kernel` (Triton, one program per (token, group), fp32 math) -> `gated_rms_norm()`
(dispatch) -> `gated_rms_norm_ref()` (the torch specification, transformers' MambaRMSNormGated,
and what runs where Triton does not). The reference is seven launches (two casts, silu, a
product, the mean of squares, the scaling, the weight); on one H200 they were ~0.3 ms of a
2.15 ms decode step of the Bamba shape at batch 64 (18 mixers). The kernel rounds where the
reference rounds: the normalised row once to the input dtype, then the product with the weight.
Compiled, silu calls libdevice's expf as torch's CUDA kernel does (activation.py).
"""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.triton_utils import HAS_TRITON, TRITON_INTERPRET, tl, triton, use_triton

if HAS_TRITON:
    from triton.language.extra import libdevice

_MAX_BLOCK = 16384  # one group must fit one program's registers; wider groups take the reference


def gated_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    group_size: int,
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """weight * rmsnorm_per_group(x * silu(gate)), in float32, rounded to x's dtype before the weight."""
    dtype = x.dtype
    h = x.float() * torch.nn.functional.silu(gate.float())
    h = h.view(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(x.shape).to(dtype)


if HAS_TRITON:

    @triton.jit
    def _gated_rms_norm_kernel(
        x_ptr,  # [num_tokens, hidden], row stride x_stride, unit column stride
        x_stride,
        gate_ptr,  # [num_tokens, hidden], row stride gate_stride, unit column stride
        gate_stride,
        weight_ptr,  # [hidden]
        out_ptr,  # [num_tokens, hidden] contiguous
        hidden,
        group_size,
        inv_group_size,
        eps,
        LIBDEVICE: tl.constexpr,  # compiled: CUDA's expf, the function torch's silu calls
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
        mask = tl.arange(0, BLOCK) < group_size
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + row * gate_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        h = x * tl.math.div_rn(g, 1.0 + e)  # x * silu(g), in torch's order
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_group_size + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * hidden + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    group_size: int,
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden], new
    """The gated norm in one launch where Triton runs (and the weight has x's dtype, so the
    output keeps it), the reference elsewhere."""
    assert x.dim() == 2 and gate.shape == x.shape and weight.shape == (x.shape[1],), (
        f"x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}"
    )
    assert x.shape[1] % group_size == 0, f"hidden {x.shape[1]} is not a multiple of group_size {group_size}"
    block = triton.next_power_of_2(group_size) if HAS_TRITON else 0
    if (
        not use_triton(x.device)
        or x.shape[0] == 0
        or weight.dtype != x.dtype
        or gate.dtype != x.dtype
        or block > _MAX_BLOCK
    ):
        return gated_rms_norm_ref(x, gate, weight, group_size, eps)
    x = x if x.stride(1) == 1 else x.contiguous()
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[(x.shape[0], x.shape[1] // group_size)](
        x, x.stride(0), gate, gate.stride(0), weight, out, x.shape[1], group_size, 1.0 / group_size, eps,
        LIBDEVICE=not TRITON_INTERPRET, BLOCK=block, num_warps=4 if block <= 2048 else 8,
        enable_fp_fusion=False,  # no fma: each product rounded, as torch's separate kernels round them
    )  # fmt: skip
    return out


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm_per_group(x * silu(gate)), in float32. Each of the `hidden_size //
    group_size` groups is normalised on its own (Mamba2 uses one group per `n_groups`)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of group_size={group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        gate: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of x
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)
