"""Qwen2-Audio: Whisper-style audio encoder -> linear projector -> Qwen2 language model.

Each audio item becomes one embedding per pooled frame of its real (unpadded) length, written
at its `<|AUDIO|>` placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slotrunner.models.layers.media import AudioHandler, MediaItem
from slotrunner.models.layers.media_item import stack_to_device
from slotrunner.models.multimodal_lm import MultimodalLM, build_language_model
from slotrunner.models.layers.qwen2_audio_encoder import Qwen2AudioEncoder, audio_output_lengths


class Qwen2AudioHandler(AudioHandler):
    data_keys = ("input_features", "feature_attention_mask")

    @staticmethod
    def placeholder_token_id(hf_config: Any) -> int:
        return int(hf_config.audio_token_id)

    def num_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        return int(audio_output_lengths(data["feature_attention_mask"].sum(-1))[1][0])

    def check(self, data: Mapping[str, torch.Tensor], index: int) -> None:
        super().check(data, index)
        ac = self.hf_config.audio_config
        frames = 2 * ac.max_source_positions
        feats, mask = tuple(data["input_features"].shape), tuple(data["feature_attention_mask"].shape)
        if feats != (1, ac.num_mel_bins, frames) or mask != (1, frames):
            raise ValueError(
                f"audio {index}: input_features {feats} and feature_attention_mask {mask}; this model takes "
                f"[1, {ac.num_mel_bins}, {frames}] and [1, {frames}]"
            )
        frame_mask = data["feature_attention_mask"]  # its sum is the item's length in frames
        if not ((frame_mask == 0) | (frame_mask == 1)).all():
            raise ValueError(f"audio {index}: feature_attention_mask must hold only 0 and 1 (1 = a real frame)")
        if int(frame_mask.sum()) < 2:
            raise ValueError(f"audio {index} is too short: fewer than 2 feature frames")


class Qwen2AudioForConditionalGeneration(MultimodalLM):
    media_handler_cls = Qwen2AudioHandler
    checkpoint_prefixes = (
        ("language_model.model.model.", "language_model.model."),  # as transformers 5.17 writes it
        ("model.audio_tower.", "audio_tower."),  # transformers' in-memory layout
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    )

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.audio_tower = Qwen2AudioEncoder(hf_config.audio_config)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(hf_config.audio_config.d_model, hf_config.get_text_config().hidden_size)
        self.language_model = build_language_model(hf_config)

    def encode_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        device = self.audio_tower.conv1.weight.device
        features = stack_to_device(items, "input_features", device)
        masks = stack_to_device(items, "feature_attention_mask", device)
        out = self.multi_modal_projector.linear(self.audio_tower(features, masks))  # [num_items, frames / 4, hidden]
        return [row[: it.num_tokens] for row, it in zip(out.unbind(0), items)]
