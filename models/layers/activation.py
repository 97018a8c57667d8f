"""Gated activations on a fused [gate | up] projection: act(gate) * up, for any activation of
the one name table (`hf_act.py`); the kernel computes the three of `_KERNEL_ACTS`, the
reference every other.

`_gated_act_kernel` (Triton, one program per token row and block of channels) -> `gated_act()`
(dispatch) -> `gated_act_ref()` (the torch specification, and what runs where Triton does not).
The kernel rounds where the reference rounds: act(gate) to the input dtype, then the product.
Compiled, it calls libdevice's expf/erff/tanhf as torch's CUDA kernels do; the interpreter has no
libdevice and takes tl.exp and a tanh built from it (ulps apart in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.core_runner.triton_utils import HAS_TRITON, TRITON_INTERPRET, tl, triton, use_triton
from slotrunner.models.layers.hf_act import gelu_tanh, hf_activation

if HAS_TRITON:
    from triton.language.extra import libdevice

# The kernel's ACT constexpr, by the table's function: every name of one function runs it.
_KERNEL_ACTS = {F.silu: 0, F.gelu: 1, gelu_tanh: 2}
_BLOCK = 1024


def gated_act_ref(
    x: torch.Tensor,  # [..., 2 * d]: gate | up
    act: str,
) -> torch.Tensor:  # [..., d]
    gate, up = x.chunk(2, dim=-1)
    return hf_activation(act)(gate) * up


if HAS_TRITON:

    @triton.jit
    def gated_value(g, u, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, DTYPE: tl.constexpr):
        """act(g) rounded to DTYPE, times u, in fp32 (unrounded): g and u fp32 tensors. Shared with
        the skinny GEMM, which applies it to its input chunks (skinny_gemm.py)."""
        # Each formula in the order of torch's CUDA kernel for F.silu / F.gelu.
        if ACT == 0:
            if LIBDEVICE:
                e = libdevice.exp(-g)
            else:
                e = tl.exp(-g)
            a = tl.math.div_rn(g, 1.0 + e)
        elif ACT == 1:
            a = g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        else:
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            if LIBDEVICE:
                tanh = libdevice.tanh(inner)
            else:
                t = tl.exp(-2.0 * tl.abs(inner))  # in (0, 1]: no overflow
                tanh = tl.math.div_rn(1.0 - t, 1.0 + t)
                tanh = tl.where(inner < 0, -tanh, tanh)
            a = 0.5 * g * (1.0 + tanh)
        return a.to(DTYPE).to(tl.float32) * u

    @triton.jit
    def _gated_act_kernel(
        x_ptr,  # [num_tokens, 2 * d], row stride x_stride, unit column stride
        x_stride,
        out_ptr,  # [num_tokens, d] contiguous
        d,
        ACT: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 gelu (tanh)
        LIBDEVICE: tl.constexpr,  # compiled: CUDA's exp/tanh, the functions torch's kernels call
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < d
        g = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * x_stride + d + offs, mask=mask, other=0.0).to(tl.float32)
        value = gated_value(g, u, ACT, LIBDEVICE, x_ptr.dtype.element_ty)
        tl.store(out_ptr + row * d + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


def kernel_act(act: str) -> int | None:
    """The kernels' ACT code of an activation name (`gated_value`), None for one they lack."""
    return _KERNEL_ACTS.get(hf_activation(act))


def gated_act(
    x: torch.Tensor,  # [..., 2 * d]: gate | up
    act: str,  # a name of hf_act's table
) -> torch.Tensor:  # [..., d], new
    """act(gate) * up in one launch where Triton runs and knows `act`, the torch reference elsewhere."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not gate | up"
    code = kernel_act(act)
    if code is None or not use_triton(x.device) or x.numel() == 0:
        return gated_act_ref(x, act)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(d))
    _gated_act_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2,
        x2.stride(0),
        out,
        d,
        ACT=code,
        LIBDEVICE=not TRITON_INTERPRET,
        BLOCK=block,
        enable_fp_fusion=False,  # no fma: each product rounded
    )
    return out


class GatedAct(nn.Module):
    """act(gate) * up, where the input is [..., 2 * d] = [gate | up]."""

    def __init__(self, act: str) -> None:
        super().__init__()
        hf_activation(act)  # ValueError here, at build time, for a name the table lacks
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_act(x, self.act)
