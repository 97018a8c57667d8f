"""Qwen2-VL: a ViT with 2-D RoPE and patch merging -> Qwen2 language model with M-RoPE.

Each image of grid (t, h, w) patches becomes t*h*w / spatial_merge_size^2 embeddings, written at
its `<|image_pad|>` tokens. The language model's rotary positions have three axes (see
layers/mrope.py); the ModelState computes them when a request is admitted and hands them to
`forward` as `mrope_positions`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slotrunner.models.layers.media import ImageHandler, MediaItem
from slotrunner.models.layers.media_item import stack_to_device
from slotrunner.models.layers.mrope import qwen2_vl_prompt_positions
from slotrunner.models.multimodal_lm import MultimodalLM, build_language_model
from slotrunner.models.layers.qwen2_vl_vision import Qwen2VLVisionTower


class Qwen2VLImageHandler(ImageHandler):
    data_keys = ("pixel_values", "image_grid_thw")
    device_pixels = "pixel_values"  # [patches, C * T * P * P]: each patch row holds its channels in turn

    @staticmethod
    def placeholder_token_id(hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    def num_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        return int(data["image_grid_thw"].prod()) // self.hf_config.vision_config.spatial_merge_size**2

    def check(self, data: Mapping[str, torch.Tensor], index: int) -> None:
        super().check(data, index)
        vc = self.hf_config.vision_config
        grid, pixels = data["image_grid_thw"], data["pixel_values"]
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        if tuple(grid.shape) != (1, 3) or grid.is_floating_point():
            raise ValueError(f"image {index}: image_grid_thw must be an integer [1, 3] (t, h, w), got {tuple(grid.shape)}")
        t, h, w = grid[0].tolist()
        merge = vc.spatial_merge_size
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"image {index}: grid (t, h, w) = {(t, h, w)}; h and w must be positive multiples of {merge}")
        if tuple(pixels.shape) != (t * h * w, patch_dim):
            needed = [t * h * w, patch_dim]
            raise ValueError(f"image {index}: pixel_values {tuple(pixels.shape)}; grid {(t, h, w)} needs {needed}")

    def split(self, outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
        grids = outputs["image_grid_thw"]
        pixels = outputs["pixel_values"].split(grids.prod(-1).tolist())
        return [{"pixel_values": pixels[i], "image_grid_thw": grids[i : i + 1]} for i in range(num_items)]

    def preprocess(self, raw: list[Any], processor: Any) -> Mapping[str, torch.Tensor]:
        out = super().preprocess(raw, processor)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


class Qwen2VLForConditionalGeneration(MultimodalLM):
    media_handler_cls = Qwen2VLImageHandler
    uses_mrope = True
    checkpoint_prefixes = (
        ("model.language_model.", "language_model.model."),  # transformers' in-memory layout
        ("model.visual.", "visual."),
        ("model.", "language_model.model."),  # the layout transformers 5.x writes
        ("lm_head.", "language_model.lm_head."),
    )

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        self.visual = Qwen2VLVisionTower(hf_config.vision_config)
        self.language_model = build_language_model(hf_config)
        if self.language_model.args.mrope_section is None:
            raise ValueError("Qwen2-VL's text config has no rope_parameters.mrope_section")

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
        mrope_positions: torch.Tensor | None = None,  # [3, num_tokens]; None: text only (all axes = positions)
    ) -> torch.Tensor:
        rope_positions = positions if mrope_positions is None else mrope_positions
        return self.language_model(input_ids, rope_positions, inputs_embeds)

    def encode_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        device = self.visual.patch_embed.proj.weight.device
        pixels = stack_to_device(items, "pixel_values", device)
        grids = torch.cat([it.data["image_grid_thw"] for it in items])
        return list(self.visual(pixels, grids).split([it.num_tokens for it in items]))

    def mrope_prompt_positions(
        self, prompt_len: int, items: Sequence[MediaItem], offsets: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        """[3, prompt_len] positions of a prompt whose item k starts at offsets[k], and its delta."""
        spans = [(off, *it.data["image_grid_thw"][0].tolist()) for it, off in zip(items, offsets)]
        return qwen2_vl_prompt_positions(prompt_len, spans, self.spatial_merge_size)
