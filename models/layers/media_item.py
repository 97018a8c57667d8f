"""MediaItem: one preprocessed media item of a request, what a model's tower encodes in a step.

Intake builds it (models/layers/media.py reads the user's media, model_states/multimodal_intake.py
places it in the prompt); the multimodal ModelState caches its embedding by `content_hash` and
hands it to the model's `encode_media`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaItem:
    """One preprocessed media item of a request."""

    modality: str  # "image" | "audio"
    data: Mapping[str, torch.Tensor]  # the processor's tensors for this item alone, batch dim first
    num_tokens: int  # placeholder tokens it fills = rows of its embedding
    content_hash: str  # of `data`: identical media share one encoder run


def stack_to_device(items: Sequence[MediaItem], key: str, device: torch.device) -> torch.Tensor:
    """The items' `key` tensors concatenated along their batch dim, on `device` -- what a tower
    takes in a step. On CUDA they are gathered into page-locked memory first (the same one copy
    `torch.cat` makes): a copy from pageable memory, non_blocking or not, has the host wait for
    every kernel queued before it (under async scheduling, the step in flight), while one from
    page-locked memory is queued behind them and the host goes on preparing the step."""
    tensors = [it.data[key] for it in items]
    if device.type != "cuda":
        return torch.cat(tensors).to(device)
    first = tensors[0]
    staged = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    torch.cat(tensors, out=staged)
    # The caching host allocator keeps the staged block until this copy has run.
    return staged.to(device, non_blocking=True)
