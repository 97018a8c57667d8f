"""MediaItem: one preprocessed media item of a request, what a model's tower encodes in a step.

Intake builds it (models/layers/media.py reads the user's media, model_states/multimodal_intake.py
places it in the prompt); the multimodal ModelState caches its embedding by `content_hash` and
hands it to the model's `encode_media`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaItem:
    """One preprocessed media item of a request."""

    modality: str  # "image" | "audio"
    data: Mapping[str, torch.Tensor]  # the processor's tensors for this item alone, batch dim first
    num_tokens: int  # placeholder tokens it fills = rows of its embedding
    content_hash: str  # of `data`: identical media share one encoder run
