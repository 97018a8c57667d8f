"""Decode steps of Llama-form decoders on a CPU with one native call per layer
(`core_runner/cpu/decoder_layer.c`).

At batch 1 a small model's decode step was mostly Python: ~40 module calls and torch ops a
layer around a few native kernels. When every row of a step is one the CPU attention backend
serves natively (decodes, decodes with a few drafts), the weights are packed and float32, a
layer whose parts fit (`NativeLayerParts`, given by the layer itself) runs its attention half
and its gate/up projection as one `sr_decode_layer` call; the activation (torch's) and
the down projection follow as the modules would run them. The call sequences the very kernels
the modules dispatch to, on the same values in the same order, so the bits are the module
path's: a row decoded here equals the same row in a mixed step that takes the modules.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.core_runner.attention.torch_ref import step_plan
from slotrunner.core_runner.cpu.attention import CpuBackend, native_rows
from slotrunner.core_runner.cpu.native import LINEAR_FORMATS, NativeKernelError, load_library
from slotrunner.core_runner.cpu.packed import packed_linear
from slotrunner.models.layers.activation import gated_act


@dataclass(frozen=True)
class NativeLayerParts:
    """A decoder layer of the form norm -> fused q/k/v -> RoPE -> attention -> o -> norm ->
    fused gate/up -> act -> down, residual added inside the norms: what a layer hands over
    (`native_parts()`) when it has that form. The weights still have to be packed and the
    attention plain for the native path to take it."""

    input_norm: nn.Module  # RMSNorm
    qkv: nn.Module  # Linear / MergedLinear with `packed`
    cos_sin: torch.Tensor  # [max_position, rotary_dim]
    attn: nn.Module  # the Attention layer (spec, bound kv_cache)
    o: nn.Module
    post_norm: nn.Module
    gate_up: nn.Module
    act: str
    down: nn.Module
    q_norm: nn.Module | None = None  # per-head RMSNorms of q and k before RoPE (Qwen3)
    k_norm: nn.Module | None = None


class _Packed(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("qs", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("unit_offset", ctypes.c_int64), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("q_eps", ctypes.c_float), ("k_eps", ctypes.c_float), ("qkv", _Packed), ("o", _Packed), ("gate_up", _Packed),
        ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("rotary_half", ctypes.c_int64), ("cos_sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p), ("scale", ctypes.c_float),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64), ("hidden", ctypes.c_int64), ("positions", ctypes.c_void_p),
        ("slots", ctypes.c_void_p), ("key_slots", ctypes.c_void_p), ("rows", ctypes.c_void_p),
        ("num_rows", ctypes.c_int64), ("longest", ctypes.c_int64), ("threads", ctypes.c_int64),
        ("h", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("attn", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
    ]  # fmt: skip


def _packed(linear: nn.Module) -> _Packed | None:
    w = getattr(linear, "packed", None)
    bias = linear.bias
    if w is None or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
        return None
    return _Packed(LINEAR_FORMATS.index(w.format), w.shape[0], w.shape[1], w.qs.data_ptr(), w.scales.data_ptr(),
                   None if w.mins is None else w.mins.data_ptr(), None if bias is None else bias.data_ptr())  # fmt: skip


def _layer_struct(p: NativeLayerParts) -> _Layer | None:
    """The fixed half of a layer's call, or None when a part does not fit the native path."""
    spec, cache = p.attn.spec, p.attn.kv_cache
    norms = (p.input_norm, p.post_norm) + (() if p.q_norm is None else (p.q_norm, p.k_norm))
    packed = [_packed(m) for m in (p.qkv, p.o, p.gate_up)]
    if (
        None in packed or cache is None or cache.dtype != torch.float32 or not cache.is_contiguous()
        or spec.sliding_window is not None or spec.logits_soft_cap is not None
        or p.cos_sin.dtype != torch.float32 or not p.cos_sin.is_contiguous()
        or any(n.weight.dtype != torch.float32 for n in norms) or any(n.unit_offset != norms[0].unit_offset for n in norms)
        or getattr(p.down, "packed", None) is None or p.qkv.out_features != (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    ):  # fmt: skip
        return None
    base = cache.data_ptr()
    qk = (None, None, 0.0, 0.0) if p.q_norm is None else (p.q_norm.weight.data_ptr(), p.k_norm.weight.data_ptr(), p.q_norm.eps, p.k_norm.eps)
    return _Layer(
        norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, norms[1].eps, int(norms[0].unit_offset),
        *qk, *packed, spec.num_heads, spec.num_kv_heads, spec.head_dim, p.cos_sin.shape[-1] // 2, p.cos_sin.data_ptr(),
        base, base + cache.stride(0) * cache.element_size(), spec.scale,
    )  # fmt: skip


class NativeDecodeStack:
    """The native path of a stack of layers; `run` returns None for a step it cannot take."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self._parts: list[NativeLayerParts] | None = None
        self._structs: list[_Layer] | None = None
        self._cache_ptrs: tuple[int, ...] | None = None

    def _layer_structs(self) -> list[_Layer] | None:
        """The layers' fixed halves, built on first use and again if a KV cache is re-bound; None
        while any layer does not fit (asked once per binding, not per step)."""
        if self._parts is None:
            parts = [getattr(layer, "native_parts", lambda: None)() for layer in self.layers]
            self._parts = [] if None in parts else parts
        if not self._parts:
            return None
        ptrs = tuple(0 if p.attn.kv_cache is None else p.attn.kv_cache.data_ptr() for p in self._parts)
        if ptrs != self._cache_ptrs:
            structs = [_layer_struct(p) for p in self._parts]
            self._structs, self._cache_ptrs = (None if None in structs else structs), ptrs
        return self._structs

    def run(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the last layer, or None (nothing computed) when the step has a row
        the native attention does not take, or the model is not in native form."""
        if x.dtype != torch.float32 or x.dim() != 2 or positions.dim() != 1 or not x.numel():
            return None
        ctx = get_forward_context()
        if not isinstance(ctx.backend, CpuBackend) or ctx.group_attn:
            return None
        try:
            lib = load_library()
        except NativeKernelError:
            return None
        structs = self._layer_structs()
        if structs is None:
            return None
        meta, block_size = ctx.attn, self._parts[0].attn.kv_cache.shape[2]
        plan = step_plan(meta, block_size, x.device)
        rows, picked, longest = native_rows(meta, block_size, None)
        if len(picked) != len(plan.rows) or meta.slot_mapping.dtype != torch.int64:
            return None
        tokens, hidden = x.shape
        spec = self._parts[0].attn.spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        width = self._parts[0].qkv.out_features
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.contiguous()
        x = x.contiguous()
        scratch = [torch.empty(tokens, n) for n in (hidden, width, q_size, kv_size, q_size, hidden)]
        step = _Step(tokens, hidden, positions.data_ptr(), slots.data_ptr(), plan.key_slots.data_ptr(), rows.data_ptr(),
                     rows.shape[0], longest, torch.get_num_threads(), *(t.data_ptr() for t in scratch))  # fmt: skip
        residual = torch.empty(tokens, hidden)
        gate_up = torch.empty(tokens, self._parts[0].gate_up.out_features)
        call, res_ptr = lib.sr_decode_layer, residual.data_ptr()
        for i, (layer, part) in enumerate(zip(structs, self._parts)):
            status = call(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), res_ptr if i else None, res_ptr, gate_up.data_ptr())
            if status != 0:
                raise MemoryError("sr_decode_attention could not allocate its score buffer")
            down = part.down
            x = packed_linear(gated_act(gate_up, part.act), down.packed, down.bias)
        return x, residual
