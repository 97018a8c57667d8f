"""Whisper (WhisperForConditionalGeneration): a log-mel audio encoder and a text decoder.

The encoder takes exactly 2 * max_source_positions feature frames (intake pads audio to that
with the model's feature extractor); two convolutions, the second with stride 2, leave
max_source_positions positions. Layers are BART's, pre-norm and without key bias (models/bart.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.bart import DecoderLayer, EncoderLayer, check_decoder_split, stack_args, store_cross_kv
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.lm_head import vocab_logits
from slotrunner.models.layers.weight_aliases import resolve_aliases, share_equal_parameters
from slotrunner.models.weights import WeightLoader


class WhisperEncoder(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        a = stack_args(c, "encoder", pre_norm=True, k_bias=False)
        self.num_frames = 2 * c.max_source_positions
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.d_model)  # sinusoids, stored
        self.layers = nn.ModuleList(EncoderLayer(a) for _ in range(a.num_layers))
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [num_mel_bins, num_frames] -> [positions, d_model]
        assert features.shape[-1] == self.num_frames, f"encoder takes {self.num_frames} frames, got {features.shape[-1]}"
        x = features.to(self.conv1.weight.dtype)[None]  # [1, mel, frames]
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))[0].t()  # [frames // 2, d_model]
        x = x + self.embed_positions.weight[: x.shape[0]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoder(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        a = stack_args(c, "decoder", pre_norm=True, k_bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_target_positions, c.d_model)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:  # [num_tokens, d_model]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(c)
        self.decoder = WhisperDecoder(c)


class WhisperForConditionalGeneration(nn.Module):
    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """The decoder splits by head (bart.py); the audio encoder, embeddings and head are replicated."""
        check_decoder_split(hf_config, world_size)

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.model = WhisperModel(hf_config)
        self.proj_out = Linear(hf_config.d_model, hf_config.vocab_size, bias=False)

    def encode(self, features: torch.Tensor) -> torch.Tensor:  # [mel, frames] -> [positions, d_model]
        return self.model.encoder(features)

    def store_cross_kv(self, row: int, encoder_hidden: torch.Tensor) -> None:
        store_cross_kv(self.model.decoder.layers, row, encoder_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, d_model]
    ) -> torch.Tensor:  # [num_tokens, d_model]
        return self.model.decoder(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, d_model] -> [rows, vocab]
        return vocab_logits(hidden, self.proj_out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        embed = "model.decoder.embed_tokens.weight"
        aliases = {embed: (embed,), "proj_out.weight": ("proj_out.weight", embed)}  # tied: no proj_out in the file
        loaded = WeightLoader(self).load(resolve_aliases(weights, aliases))
        share_equal_parameters(self, [(embed, "proj_out.weight")])
        return loaded
