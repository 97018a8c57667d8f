"""MediaItem: one preprocessed media item of a request, what a model's tower encodes in a step.

Intake builds it (models/layers/media.py reads the user's media, model_states/multimodal_intake.py
places it in the prompt); the multimodal ModelState caches its embedding by `content_hash` and
hands it to the model's `encode_media`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class PixelFinish:
    """The part of an image processor's work left for the device: rescale (e.g. 1/255) and
    per-channel normalize of pixels whose every row (dim 0) holds its channels one after the
    other -- images [N, C, H, W], or flattened patches [N, C * T * P * P] (Qwen2-VL, where
    normalizing before or after the patches are cut is the same). The host hands the tower uint8
    pixels -- a quarter of the float32 bytes to hash, pickle from an intake worker and copy to the
    device, and no float pass over them on the host. The arithmetic is transformers' own
    (`image_transforms.rescale` in float64, then `normalize` in float32), so the pixels equal
    what the processor itself would have returned."""

    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def of(cls, image_processor: Any) -> PixelFinish | None:
        """What `image_processor` would rescale and normalize, or None if it does neither."""
        rescale = float(image_processor.rescale_factor) if getattr(image_processor, "do_rescale", False) else None
        mean = std = None
        if getattr(image_processor, "do_normalize", False):
            mean, std = _floats(image_processor.image_mean), _floats(image_processor.image_std)
        return None if rescale is None and mean is None else cls(rescale, mean, std)

    # The processor call's keywords that leave both steps to `__call__`.
    SKIP = {"do_rescale": False, "do_normalize": False}

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        x = (pixels.double() * self.rescale).float() if self.rescale is not None else pixels.float()
        if self.mean is None:
            return x
        rows = x.reshape(x.shape[0], len(self.mean), -1)  # [N, C, values of a channel]
        return ((rows - _channels(self.mean, x.device)) / _channels(self.std, x.device)).view(x.shape)


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values) if hasattr(values, "__iter__") else (float(values),)


@functools.lru_cache(maxsize=64)
def _channels(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Per-channel constants as [C, 1] float32 on `device`, made once (a copy to the GPU from
    a Python list waits for the device)."""
    return torch.tensor(values, dtype=torch.float32).view(-1, 1).to(device)


@dataclass(frozen=True)
class MediaItem:
    """One preprocessed media item of a request."""

    modality: str  # "image" | "audio"
    data: Mapping[str, torch.Tensor]  # the processor's tensors for this item alone, batch dim first
    num_tokens: int  # placeholder tokens it fills = rows of its embedding
    content_hash: str  # of `data`: identical media share one encoder run
    # Per data key, what the device still applies to the tensor before the tower takes it (items
    # read by a processor that leaves it for the device; none for pre-computed items).
    finish: Mapping[str, PixelFinish] = field(default_factory=dict)


def stack_to_device(items: Sequence[MediaItem], key: str, device: torch.device) -> torch.Tensor:
    """The items' `key` tensors concatenated along their batch dim, on `device`, each finished
    as its item says (`MediaItem.finish`) -- what a tower takes in a step. Items run by run of
    one finish are copied and finished together."""
    parts = []
    for finish, run in itertools.groupby(items, key=lambda it: it.finish.get(key)):
        stacked = _copy_to_device([it.data[key] for it in run], device)
        parts.append(stacked if finish is None else finish(stacked))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def concat_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """`torch.cat(tensors, out=out)` for CPU tensors, copied by numpy on the calling thread:
    torch.cat splits a copy this size over its intra-op threads, which then wait for cores the
    intake workers keep busy (one H100, 8 workers reading: the copy was nearly every host sample
    of a step's tower run; 2 cores, 16 threads: 1.3 ms against 0.14 ms for 4 images)."""
    try:
        np.concatenate([t.numpy() for t in tensors], out=out.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a tensor that requires grad
        torch.cat(list(tensors), out=out)


def _copy_to_device(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors concatenated on `device`. On CUDA they are gathered into page-locked memory
    first (the same one copy `torch.cat` makes): a copy from pageable memory, non_blocking or not, has the host wait for
    every kernel queued before it (under async scheduling, the step in flight), while one from
    page-locked memory is queued behind them and the host goes on preparing the step."""
    if device.type != "cuda":
        return torch.cat(tensors).to(device)
    first = tensors[0]
    staged = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    concat_into(tensors, staged)
    # The caching host allocator keeps the staged block until this copy has run.
    return staged.to(device, non_blocking=True)
