"""Weights kept in their GGUF block formats and multiplied by a native CPU kernel.

A decode step on a CPU reads every weight once per step, and reading float32 weights is what
bounds it. `PackedWeight` keeps a quantized GGUF tensor as its blocks (Q4_0, Q4_1 and Q4_K at
6 bits a weight once their scales are widened to float32, Q8_0 at 9, Q6_K at 10) and `packed_linear`
dequantizes them in registers inside the matmul
(`packed_linear.c`). The values are exactly the float32 weights gguf's `dequantize` gives, so
only the order of the fp32 sums differs from a dense matmul over the dequantized tensor, and
that order is the same for every row whatever the batch (the kernel is batch-invariant).

    packed = PackedWeight.from_ggml(raw_blocks, "Q4_1", (n, k))  # raw_blocks: uint8 [n, row bytes]
    y = packed_linear(x, packed, bias)  # == F.linear(x, packed.dequantize(), bias) within fp32 noise

`packed_linear_ref` is the torch reference the kernel is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotrunner.core_runner.cpu.native import NativeKernelError, load_library, native_unavailable_reason

BLOCK = 32
# GGML type name -> (packed format, values per stored block, bytes per stored block)
_GGML_BLOCKS = {
    "Q4_0": ("q4_1", 32, 18),
    "Q4_1": ("q4_1", 32, 20),
    "Q4_K": ("q4_1", 256, 144),  # 8 sub-blocks of 32, each scale and min exact in float32
    "Q8_0": ("q8_0", 32, 34),
    "Q6_K": ("q8_16", 256, 210),  # 6-bit values as int8, one scale per sub-block of 16
}
PACKABLE_GGML_TYPES = tuple(_GGML_BLOCKS)
QUANTIZED_WEIGHT_MODES = ("auto", "packed", "dequantized")


@dataclass(frozen=True)
class PackedWeight:
    """An [n, k] weight in blocks of 32 along k.

    q4_1: `qs` uint8 [n, k/2], ggml nibble order (byte j of a block: value j low, value j+16
          high); w = scales * q + mins. Q4_0 is stored as q4_1 with mins = -8 * scales, Q4_K
          with each sub-block's scale and min worked out (both exact).
    q8_0: `qs` int8 [n, k]; w = scales * q, and `mins` is None.
    q8_16: as q8_0 with one scale per 16 values, `scales` [n, k/16] (Q6_K, exactly).
    `scales` and `mins` are float32 [n, k/32] unless said otherwise (worked out exactly from
    the file's float16 and integer scales).
    """

    format: str
    shape: tuple[int, int]
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @classmethod
    def from_ggml(cls, raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> PackedWeight:
        """Repack a GGUF tensor's raw bytes ([n, row bytes] uint8) of type Q4_0, Q4_1, Q4_K, Q6_K
        or Q8_0."""
        if ggml_type not in _GGML_BLOCKS:
            raise ValueError(f"GGML type {ggml_type} cannot be packed; packable: {', '.join(PACKABLE_GGML_TYPES)}")
        n, k = shape
        fmt, block_values, block_bytes = _GGML_BLOCKS[ggml_type]
        if k % block_values or raw.shape != (n, k // block_values * block_bytes) or raw.dtype != np.uint8:
            raise ValueError(f"{ggml_type} data of shape {raw.shape} does not hold an [{n}, {k}] tensor")
        if ggml_type == "Q4_K":
            return cls._from_q4_k(np.array(raw, dtype=np.uint8, copy=True).reshape(n, k // 256, 144), n, k)
        if ggml_type == "Q6_K":
            return cls._from_q6_k(np.array(raw, dtype=np.uint8, copy=True).reshape(n, k // 256, 210), n, k)
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(n, k // BLOCK, block_bytes)
        scales = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, -1).float()
        if ggml_type == "Q4_1":
            mins = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1).float()
            qs = blocks[..., 4:].reshape(n, k // 2).contiguous()
        elif ggml_type == "Q4_0":  # d * (q - 8) == d * q + (-8 d), both exact in fp32
            mins = scales * -8.0
            qs = blocks[..., 2:].reshape(n, k // 2).contiguous()
        else:
            mins = None
            qs = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return cls(fmt, (n, k), qs, scales.contiguous(), mins)

    @classmethod
    def _from_q4_k(cls, blocks: np.ndarray, n: int, k: int) -> PackedWeight:
        """Q4_K super-blocks ([n, k/256, 144]: float16 d and dmin, twelve bytes of 6-bit
        sub-block scales and mins, 128 bytes of nibbles) as q4_1 blocks of 32. A value is
        (d * sc) * q - dmin * m: both products are exact in float32, so scales = d * sc and
        mins = -(dmin * m) give gguf's values through the same single rounding."""
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, k/256, 1]
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        packed = blocks[..., 4:16].reshape(n, -1, 3, 4)  # the 6-bit scales and mins, ggml's packing
        lo, hi, extra = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [n, k/256, 8]
        mn = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        scales = (d * sc.astype(np.float32)).reshape(n, k // BLOCK)
        mins = -(dmin * mn.astype(np.float32)).reshape(n, k // BLOCK)
        # Nibbles: each 32 bytes hold sub-block 2g in their low halves, 2g + 1 in their high ones.
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        values = (qs & 0x0F).reshape(n, k // BLOCK, BLOCK)
        nibbles = values[..., :16] | (values[..., 16:] << 4)  # ggml's q4_1 order: j low, j + 16 high
        t = torch.from_numpy
        return cls("q4_1", (n, k), t(nibbles.reshape(n, k // 2).copy()), t(scales.copy()), t(mins.copy()))

    @classmethod
    def _from_q6_k(cls, blocks: np.ndarray, n: int, k: int) -> PackedWeight:
        """Q6_K super-blocks ([n, k/256, 210]: 128 bytes of low nibbles, 64 of high bit pairs,
        16 int8 sub-block scales, float16 d) as int8 values q - 32 with float32 scales d * sc
        per 16 values. gguf computes (d * sc) * (q - 32) with d * sc exact, so one float32
        multiply in the kernel gives its values."""
        ql = blocks[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, -1, 256)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        qh = (qh & 0x03).reshape(n, -1, 256)
        q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, k/256, 16]
        d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [n, k/256, 1]
        scales = (d * sc).reshape(n, k // 16)
        return cls("q8_16", (n, k), torch.from_numpy(q.copy()), torch.from_numpy(scales.copy()), None)

    def dequantize(self) -> torch.Tensor:
        """The float32 [n, k] weight (the reference for the kernel's in-register dequantization)."""
        n, k = self.shape
        if self.format == "q4_1":
            qs = self.qs.view(n, k // BLOCK, BLOCK // 2)
            q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [n, blocks, 32]
            w = torch.addcmul(self.mins.unsqueeze(-1), self.scales.unsqueeze(-1), q)
        else:  # q8_0 and q8_16: one scale per 32 or per 16 values
            group = k // self.scales.shape[1]
            w = self.scales.unsqueeze(-1) * self.qs.view(n, k // group, group).float()
        return w.reshape(n, k)

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """Rows `index` of the weight, in that order (a permutation, or a slice of outputs)."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()  # noqa: E731
        return PackedWeight(self.format, (len(index), self.shape[1]), pick(self.qs), pick(self.scales), pick(self.mins))

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Stack weights along the outputs (fused q/k/v or gate/up); one format, one k."""
        formats, ks = {p.format for p in parts}, {p.shape[1] for p in parts}
        if len(formats) != 1 or len(ks) != 1:
            raise ValueError(f"cannot stack packed weights of formats {sorted(formats)} and input sizes {sorted(ks)}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        n = sum(p.shape[0] for p in parts)
        return PackedWeight(parts[0].format, (n, ks.pop()), torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]), mins)

    @functools.cached_property
    def _kernel(self) -> tuple[Any, int, int, int | None]:
        """The kernel for this format and the weight's data pointers (the tensors never move)."""
        fn = getattr(load_library(), f"sr_linear_{self.format}")
        return fn, self.qs.data_ptr(), self.scales.data_ptr(), None if self.mins is None else self.mins.data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for float32 `x` [..., k] on the CPU, through the native kernel."""
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"packed_linear takes float32 CPU input [..., {k}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"packed_linear bias must be float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    x2 = x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        fn, qs, scales, mins = weight._kernel
        bias_ptr = None if bias is None else bias.contiguous().data_ptr()
        fn(x2.data_ptr(), rows, k, qs, scales, mins, n, bias_ptr, y.data_ptr(), torch.get_num_threads())
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def packed_linear_ref(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight.dequantize(), bias)


def should_pack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized GGUF tensors stay packed, for `LLM(quantized_weights=mode)`.

    "auto" packs on a CPU with float32 activations when the native kernel builds; "packed"
    requires that and raises ValueError saying what is missing; "dequantized" never packs.
    """
    if mode not in QUANTIZED_WEIGHT_MODES:
        raise ValueError(f"quantized_weights {mode!r} is not one of {QUANTIZED_WEIGHT_MODES}")
    if mode == "dequantized":
        return False
    problem = None
    if device.type != "cpu":
        problem = f"packed weights run on the CPU only, the device is {device}"
    elif dtype != torch.float32:
        problem = f"packed weights need dtype float32 activations, got {dtype}"
    else:
        problem = native_unavailable_reason()
    if problem is not None and mode == "packed":
        raise ValueError(f"quantized_weights='packed': {problem}; use quantized_weights='dequantized'")
    return problem is None


__all__ = [
    "NativeKernelError", "PACKABLE_GGML_TYPES", "PackedWeight", "QUANTIZED_WEIGHT_MODES",
    "packed_linear", "packed_linear_ref", "should_pack",
]
