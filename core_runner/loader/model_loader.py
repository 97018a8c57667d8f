"""Building a model: resolve its architecture, construct it, and fill its weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from slotrunner.registry import ResolvedArch, resolve

LOAD_FORMATS = ("auto", "dummy")


def build_model(hf_config: object, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, ResolvedArch]:
    arch = resolve(hf_config)
    with torch.device(device):
        model = arch.model_cls(hf_config)
    # Parameters take the requested dtype; buffers (RoPE tables) stay float32 on purpose.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False), arch


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    model.load_weights(weights)


def random_init(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices, norms near 1, biases near 0."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                value = noise * 0.02
            elif "norm" in name:
                value = 1.0 + 0.02 * noise
            else:
                value = 0.02 * noise
            p.copy_(value.to(p.dtype))


def load_model(
    hf_config: object,
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[nn.Module, ResolvedArch]:
    """Build the model for `hf_config` and fill it from `weights()` (or randomly: "dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    model, arch = build_model(hf_config, dtype, device)
    if load_format == "dummy":
        random_init(model, seed)
    else:
        load_weights(model, weights())
    return model, arch
