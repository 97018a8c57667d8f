"""Building a model: construct its class (the registry resolved it) and fill its weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

LOAD_FORMATS = ("auto", "dummy")


@contextmanager
def _parameters_in(dtype: torch.dtype) -> Iterator[None]:
    """Every parameter a module registers meanwhile takes `dtype` as it is registered. Layers
    create their parameters in float32 (torch's default): converted only after the whole model
    was built, a 30B-parameter model first held 122 GB on the device and could not be built on
    an 80 GB card whose memory holds it in bfloat16 (61 GB). Now at most one parameter is in
    float32 at a time. Buffers (RoPE tables) keep their dtype on purpose."""
    register = nn.Module.register_parameter

    def register_in_dtype(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)
        register(module, name, param)

    nn.Module.register_parameter = register_in_dtype
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_model(model_cls: Callable[[object], nn.Module], hf_config: object, dtype: torch.dtype, device: torch.device) -> nn.Module:
    try:
        with torch.device(device), _parameters_in(dtype):
            model = model_cls(hf_config)
    except torch.OutOfMemoryError as e:  # say what the model needs, not only the allocation that failed
        raise torch.OutOfMemoryError(_does_not_fit(model_cls, hf_config, dtype, torch.device(device), e)) from e
    for p in model.parameters():  # any a module set without registering it (no copy for the others)
        p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def _does_not_fit(model_cls: Callable[[object], nn.Module], hf_config: object, dtype: torch.dtype, device: torch.device,
                  error: BaseException) -> str:
    """The message for a model whose parameters did not fit: their size (this rank's shard under
    tensor parallelism), from the model built again on the meta device (nothing allocated)."""
    with torch.device("meta"), _parameters_in(dtype):
        need = sum(p.numel() * p.element_size() for p in model_cls(hf_config).parameters())
    where = f"{device}"
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB in all)"
    return (
        f"{model_cls.__name__}'s parameters take {need / 2**30:.2f} GiB in {str(dtype).removeprefix('torch.')} and did "
        f"not fit on {where}, beside what else it holds; the KV cache and activations need room too. A "
        f"smaller dtype, tensor_parallel_size > 1 or a device with more memory would. ({error})"
    )


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    model.load_weights(weights)


def random_init(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices, norms near 1, biases near 0. Drawn on
    each parameter's own device (one CPU generator took minutes for a 30B-parameter model)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            value = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=p.device).mul_(0.02)
            if p.dim() < 2 and "norm" in name:
                value.add_(1.0)
            p.copy_(value)


def load_model(
    model_cls: Callable[[object], nn.Module],
    hf_config: object,
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """Build `model_cls(hf_config)` and fill it from `weights()` (or randomly: "dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    model = build_model(model_cls, hf_config, dtype, device)
    if load_format == "dummy":
        random_init(model, seed)
    else:
        load_weights(model, weights())
    return model
