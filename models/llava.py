"""LLaVA: CLIP vision tower -> two-layer projector -> Llama-family language model.

Each image becomes (image_size / patch_size)^2 embeddings (one more with the "full" feature
strategy, which keeps the class token), written at its `<image>` placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slotrunner.models.layers.clip import CLIPVisionTower
from slotrunner.models.layers.hf_act import Act
from slotrunner.models.layers.media import ImageHandler, MediaItem
from slotrunner.models.layers.media_item import stack_to_device
from slotrunner.models.multimodal_lm import MultimodalLM, build_language_model
from slotrunner.models.weights import QKV_SHARDS


def _feature_layers(hf_config: Any) -> list[int]:
    layers = hf_config.vision_feature_layer
    return [layers] if isinstance(layers, int) else list(layers)


class LlavaImageHandler(ImageHandler):
    data_keys = ("pixel_values",)
    device_pixels = "pixel_values"

    @staticmethod
    def placeholder_token_id(hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    def num_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        vc = self.hf_config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n + 1 if self.hf_config.vision_feature_select_strategy == "full" else n

    def check(self, data: Mapping[str, torch.Tensor], index: int) -> None:
        super().check(data, index)
        size = self.hf_config.vision_config.image_size
        shape = tuple(data["pixel_values"].shape)
        if len(shape) != 4 or shape[0] != 1 or shape[2:] != (size, size):
            raise ValueError(f"image {index}: pixel_values of shape {shape}; this model takes [1, 3, {size}, {size}]")

    def from_tensor(self, t: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
        return self.precomputed({"pixel_values": t if t.dim() == 4 else t[None]}, index)


class LlavaProjector(nn.Module):
    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = Act(act)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultimodalLM):
    media_handler_cls = LlavaImageHandler
    checkpoint_prefixes = (
        ("vision_tower.vision_model.", "vision_tower."),  # published llava-hf checkpoints
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),  # transformers >= 4.52 in-memory layout
        ("lm_head.", "language_model.lm_head."),
    )

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vc = hf_config.vision_config
        if vc.model_type != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vc.model_type!r} vision tower is not supported (supported: clip_vision_model)")
        if hf_config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} is not supported")
        layers = _feature_layers(hf_config)
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"
        self.vision_tower = CLIPVisionTower(vc, layers)
        text_dim = hf_config.get_text_config().hidden_size
        self.multi_modal_projector = LlavaProjector(
            vc.hidden_size * len(layers), text_dim, hf_config.projector_hidden_act, hf_config.multimodal_projector_bias
        )
        self.language_model = build_language_model(hf_config)

    def encode_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        return list(self.encode_stacked(self.stack_media(items)).unbind(0))

    # Every image has the config's size, so the state may replay the tower as a CUDA graph
    # (model_states/tower_graphs.py).
    def stack_media(self, items: Sequence[MediaItem]) -> torch.Tensor:  # [num_images, 3, H, W]
        return stack_to_device(items, "pixel_values", self.vision_tower.embeddings.class_embedding.device)

    def encode_stacked(self, pixels: torch.Tensor) -> torch.Tensor:  # -> [num_images, patches, text hidden]
        features = self.vision_tower(pixels)  # [num_images, 1 + patches, dim]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def tower_merged_weights(self) -> dict[str, tuple[str, str]]:
        return QKV_SHARDS
