"""Building a model: construct its class (the registry resolved it) and fill its weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

LOAD_FORMATS = ("auto", "dummy")


def build_model(model_cls: Callable[[object], nn.Module], hf_config: object, dtype: torch.dtype, device: torch.device) -> nn.Module:
    with torch.device(device):
        model = model_cls(hf_config)
    # Parameters take the requested dtype; buffers (RoPE tables) stay float32 on purpose.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


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
