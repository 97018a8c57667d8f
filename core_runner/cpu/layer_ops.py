"""The per-layer ops of `layer_ops.c` (RMSNorm with the residual add, rotary on q and k, the KV
cache write) for float32 CPU tensors: one native call each where the torch reference issues two
to fifteen ops.

`models/layers/norm.py` and `rotary_qk.py` dispatch here on a CPU, as they dispatch to Triton on
a GPU, and keep the reference for everything else (other dtypes, tensors that need gradients,
no C compiler). The rotation gives the reference's bits; RMSNorm sums its squares in a fixed
order of its own, so it equals the reference to float32 rounding, independently of the batch.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.cpu.native import NativeKernelError, load_library


def native_for(*tensors: torch.Tensor):
    """The library when every tensor is float32 on the CPU, needs no gradient, and the kernels
    load; else None (the caller runs its torch reference)."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or (t.requires_grad and torch.is_grad_enabled()):
            return None
    try:
        return load_library()
    except NativeKernelError:
        return None


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_native(
    lib, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """`rms_norm_ref`'s result (new tensors; x and residual are not written)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out = None if residual is None else torch.empty(x.shape, dtype=torch.float32)
    res2 = None if residual is None else _rows(residual, n)
    weight = weight if weight.is_contiguous() else weight.contiguous()
    lib.sr_rms_norm(
        x2.data_ptr(), x2.stride(0), None if res2 is None else res2.data_ptr(), 0 if res2 is None else res2.stride(0),
        weight.data_ptr(), eps, int(unit_offset), x2.shape[0], n, out.data_ptr(), None if res_out is None else res_out.data_ptr(),
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def rotary_qk_native(lib, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q [tokens, heads, head_dim] and k in place (channels contiguous) by `cos_sin`."""
    positions = positions.to(torch.int64).contiguous()
    cos_sin = cos_sin if cos_sin.is_contiguous() else cos_sin.contiguous()
    lib.sr_rotary_qk(
        positions.data_ptr(), q.shape[0],
        q.data_ptr(), q.stride(0), q.stride(1), q.shape[1],
        k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
        cos_sin.data_ptr(), cos_sin.shape[-1] // 2,
    )  # fmt: skip


def write_kv_native(lib, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """`write_kv` of k, v [tokens, kv_heads, head_dim] into a contiguous float32 cache in one call
    (the reference's conversions and two index_copy_ cost ~20 us a layer at decode); False,
    writing nothing, where it does not apply. Pointer arithmetic, not views: at decode sizes a
    view or an index costs more than the copy."""
    _, _, _, heads, dim = kv_cache.shape
    f32 = torch.float32
    if (
        kv_cache.dtype != f32 or k.dtype != f32 or v.dtype != f32 or slot_mapping.dtype != torch.int64
        or not kv_cache.is_contiguous() or not slot_mapping.is_contiguous()
        or k.stride()[1:] != (dim, 1) or v.stride()[1:] != (dim, 1) or k.shape[1:] != (heads, dim) or v.shape[1:] != (heads, dim)
    ):  # fmt: skip
        return False
    base = kv_cache.data_ptr()
    lib.sr_write_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), k.shape[0], heads * dim,
        base, base + kv_cache.stride(0) * 4,
    )  # fmt: skip
    return True
