"""RMSNorm, optionally fused with the residual add.

`_rms_norm_kernel` (Triton, one program per token row, fp32 math) -> `rms_norm()` (dispatch) ->
`rms_norm_ref()` (the torch specification, and what runs where Triton does not). The kernel
rounds where the reference rounds, so bf16 results match transformers as eager torch does: the
residual sum is rounded to the input dtype before the norm reads it, and the normalized row is
rounded to the input dtype before the weight multiplies it (HF's `weight * h.to(dtype)`).

`unit_offset` is Gemma's form: the stored weight w is an offset from 1, the scale is 1 + w in
fp32, and the product is rounded once (HF's `(h * (1.0 + w.float())).type_as(x)`), so the output
keeps the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.cpu.layer_ops import native_for, rms_norm_native
from slotrunner.core_runner.triton_utils import HAS_TRITON, pdl_launch, tl, triton, use_triton

_MAX_BLOCK = 32768  # one row must fit one program's registers; wider rows take the reference


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
    unit_offset: bool = False,  # Gemma: scale by (1 + weight), see the module docstring
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(dtype) if unit_offset else weight * h.to(dtype)
    return out if residual is None else (out, residual)


if HAS_TRITON:
    from slotrunner.core_runner.triton_utils import pdl_enter

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [num_tokens, hidden], row stride x_stride
        x_stride,
        res_ptr,  # [num_tokens, hidden], row stride res_stride (unused without HAS_RESIDUAL)
        res_stride,
        weight_ptr,  # [hidden]
        out_ptr,  # [num_tokens, hidden] contiguous
        res_out_ptr,  # [num_tokens, hidden] contiguous, x + residual (unused without HAS_RESIDUAL)
        hidden,
        inv_hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,  # triton_utils.pdl_launch
    ):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded, as x + residual
            tl.store(res_out_ptr + row * hidden + offs, x, mask=mask)
        h = x.to(tl.float32)
        # torch's CUDA mean multiplies the sum by 1 / n; the sum's order differs anyway.
        h = h * tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_hidden + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:  # Gemma: h * (1 + w) in fp32, rounded once
            out = h * (1.0 + w)
        else:
            out = h.to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with unit column stride (a view where strides allow)."""
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden], same shape and dtype as x
    unit_offset: bool = False,  # Gemma: scale by (1 + weight)
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """norm(x), or (norm(x + residual), x + residual) -- one launch where Triton runs, one native
    call for float32 on a CPU, the torch reference elsewhere. Outputs are new tensors: x and residual are never written (x may be a
    caller's buffer, e.g. inputs_embeds as the first layer's residual)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} does not match hidden size {hidden}"
    assert residual is None or residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
    if x.device.type == "cpu":  # one native call for float32 (core_runner/cpu/layer_ops.py)
        lib = native_for(x, weight) if residual is None else native_for(x, weight, residual)
        if lib is not None and x.numel():
            return rms_norm_native(lib, x, weight, eps, residual, unit_offset)
    block = triton.next_power_of_2(hidden) if HAS_TRITON else 0
    if (
        not use_triton(x.device)
        or x.numel() == 0
        or block > _MAX_BLOCK
        or (residual is not None and residual.dtype != x.dtype)
    ):
        return rms_norm_ref(x, weight, eps, residual, unit_offset)
    x2 = _rows(x, hidden)
    res2 = x2 if residual is None else _rows(residual, hidden)
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        x2.stride(0),
        res2,
        res2.stride(0),
        weight,
        out,
        res_out,
        hidden,
        1.0 / hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        enable_fp_fusion=False,  # no fma: round each product like torch's separate kernels
        **pdl_launch(x.device),
    )
    return out if residual is None else (out, res_out)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        # With `unit_offset` (Gemma) the weight is an offset from 1: zeros are the identity scale.
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """With `residual`, returns (norm(x + residual), x + residual) like the decoder layers need."""
        return rms_norm(x, self.weight, self.eps, residual, self.unit_offset)
