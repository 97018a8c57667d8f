"""Which attention backend a runner uses on a device."""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionBackend
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
from slotrunner.core_runner.attention.triton_attn import TritonBackend
from slotrunner.core_runner.cpu.attention import CpuBackend
from slotrunner.core_runner.cpu.native import native_unavailable_reason
from slotrunner.core_runner.triton_utils import use_triton


def select_attn_backend(device: torch.device) -> AttentionBackend:
    """The Triton backend where Triton kernels run (CUDA, or the interpreter when forced); on a
    CPU the reference with native decode rows (`CpuBackend`) when the native kernels build; the
    torch reference elsewhere."""
    if use_triton(device):
        return TritonBackend()
    if device.type == "cpu" and native_unavailable_reason() is None:
        return CpuBackend()
    return TorchRefBackend()
