"""Building a model: parameters in the requested dtype from the moment each is registered."""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.loader.model_loader import build_model


class _Probe(nn.Module):
    """Records the dtype its first layer's weight had while the model was still being built."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.seen_while_building = self.first.weight.dtype
        self.second = nn.Linear(8, 8, bias=False)
        self.second.weight = self.first.weight  # tied: one parameter
        self.register_buffer("table", torch.arange(4, dtype=torch.float32) / 3)
        self.register_parameter("absent", None)


def test_parameters_take_the_dtype_as_they_are_registered():
    model = build_model(_Probe, None, torch.bfloat16, torch.device("cpu"))
    # Converted only after the build, a 30B model was held in float32 (2x its size) on the device.
    assert model.seen_while_building == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.second.weight is model.first.weight
    assert model.table.dtype == torch.float32, "buffers keep their dtype"
    assert model.absent is None and not model.training


def test_registration_is_restored_after_the_build():
    build_model(_Probe, None, torch.bfloat16, torch.device("cpu"))
    assert nn.Linear(2, 2).weight.dtype == torch.float32


class _TooLarge(nn.Module):
    """~4.66 GiB of bfloat16 parameters: built on the meta device only; anywhere else it fails as
    a device without the memory would."""

    def __init__(self, config: object) -> None:
        super().__init__()
        if torch.empty(0).device.type != "meta":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB.")
        self.w = nn.Parameter(torch.empty(50_000, 50_000))


def test_running_out_of_memory_says_what_the_model_needs():
    import pytest

    with pytest.raises(torch.OutOfMemoryError, match=r"_TooLarge's parameters take 4\.66 GiB in bfloat16 and did not fit on cpu") as info:
        build_model(_TooLarge, None, torch.bfloat16, torch.device("cpu"))
    assert "tensor_parallel_size" in str(info.value) and "Tried to allocate 1.50 GiB" in str(info.value)
    assert nn.Linear(2, 2).weight.dtype == torch.float32, "registration restored after the failure"
