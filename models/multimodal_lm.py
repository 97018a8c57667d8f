"""MultimodalLM: the shell of a model that feeds media embeddings into a Llama-family language model.

A subclass builds its towers and projector beside `self.language_model` and implements
`encode_media`. What the multimodal ModelState relies on (the family's model contract, declared
as the `MultimodalModel` protocol in model_states/multimodal.py and checked at resolve time):

- `media_handler_cls`: how intake reads the media (see layers/media.py);
- `uses_mrope`: forward takes `mrope_positions` [3, num_tokens], and `mrope_prompt_positions`
  computes them for a prompt;
- `embed_input_ids`, `encode_media`: the two halves that are merged into the input embeddings;
- optionally `stack_media` / `encode_stacked`, for a tower whose items share one input shape
  (LLaVA): the state then replays it as CUDA graphs (model_states/tower_graphs.py);
- `forward(input_ids, positions, inputs_embeds=None)`, `compute_logits`, `load_weights`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from slotrunner.models.layers.media import MediaHandler, MediaItem
from slotrunner.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from slotrunner.models.weights import WeightLoader

# text_config.model_type -> the language model class that serves it
LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen2_vl_text": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_language_model(hf_config: Any) -> LlamaForCausalLM:
    """The language model of a multimodal config; the top-level `tie_word_embeddings` wins
    (that is the flag transformers ties by)."""
    text_config = copy.deepcopy(hf_config.get_text_config())
    model_type = getattr(text_config, "model_type", None)
    if model_type not in LANGUAGE_MODELS:
        raise ValueError(
            f"language model type {model_type!r} is not supported inside {type(hf_config).__name__} "
            f"(supported: {sorted(LANGUAGE_MODELS)})"
        )
    tied = getattr(hf_config, "tie_word_embeddings", None)
    if tied is not None:
        text_config.tie_word_embeddings = bool(tied)
    return LANGUAGE_MODELS[model_type](text_config)


class MultimodalLM(nn.Module):
    media_handler_cls: ClassVar[type[MediaHandler]]
    uses_mrope: ClassVar[bool] = False
    # On-disk name prefix -> in-memory prefix, first match wins: transformers versions and
    # published checkpoints lay the same weights out differently.
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

    language_model: LlamaForCausalLM

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, world_size: int) -> None:
        """Under tensor parallelism the language model is split (as the decoder it is) and the
        towers and projector, built from plain layers, are replicated on every rank."""
        text_config = hf_config.get_text_config()
        language_model = LANGUAGE_MODELS.get(getattr(text_config, "model_type", None))
        if language_model is not None:  # else building it raises, naming the type
            language_model.check_tensor_parallel(text_config, world_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden], media merged
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.language_model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return self.language_model.model.embed_tokens(input_ids)

    def encode_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        """One embedding [item.num_tokens, hidden] per item, in order; items may be batched."""
        raise NotImplementedError

    def mrope_prompt_positions(
        self, prompt_len: int, items: Sequence[MediaItem], offsets: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        """[3, prompt_len] positions and the delta after the prompt; called only with uses_mrope."""
        raise NotImplementedError(f"{type(self).__name__} sets uses_mrope but does not compute M-RoPE positions")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model streams through its own loader (fused q/k/v and gate/up); the
        towers' tensors, set aside on the way, load afterwards without those fusions (an
        audio encoder's k_proj has no bias and stays separate)."""
        towers: list[tuple[str, torch.Tensor]] = []

        def language_model_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = self._rename(name)
                if name.startswith("language_model."):
                    yield name[len("language_model.") :], tensor
                else:
                    towers.append((name, tensor))

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(language_model_weights())}
        others = nn.ModuleDict({n: m for n, m in self.named_children() if n != "language_model"})
        loaded |= WeightLoader(others, merged=self.tower_merged_weights()).load(towers)
        return loaded

    def tower_merged_weights(self) -> dict[str, tuple[str, str]]:
        """Fusions for the towers' tensors (WeightLoader's `merged`); none by default."""
        return {}

    def _rename(self, name: str) -> str:
        for old, new in self.checkpoint_prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name
