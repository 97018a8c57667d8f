"""EncoderDecoderModelState: one encoder run per admission, cross-attention K/V kept per slot.

The decoder is an ordinary request to the runner: its prompt is the decoder prompt, its
self-attention uses the paged KV cache. What the family adds:

- intake (`process_prompt`, in encoder_decoder_intake.py): split a prompt into the decoder
  prompt (the request's tokens) and the encoder input (`EncoderInputs`: token ids, or audio
  features for the audio subclass);
- `add_request` stashes the encoder input for the slot; `preprocess_state` runs the encoder
  for the slots admitted since the last step and writes every decoder layer's cross-attention
  K/V into the slot's row of a per-slot cache allocated once in `initialize_cache`;
- `prepare_attn` tells the cross-attention layers each batch row's slot and encoder length.

A preempted request loses its row with its slot and is encoded again on re-admission. See
docs/encoder_decoder.md for the design and its memory cost.

The model module of an encoder-decoder provides, besides forward / compute_logits /
load_weights: `hf_config`, `encode(encoder_input) -> [encoder_len, hidden]` for one request,
`store_cross_kv(slot, encoder_hidden)`, and one `CrossAttention` layer per decoder layer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.engine.intake import IntakeContext, ProcessedPrompt, PromptType
from slotrunner.core_runner.runner.model_state import CacheSpec, ModelInputs, ModelState
from slotrunner.model_states.encoder_decoder_intake import (
    EncoderInputs,
    max_encoder_len,
    process_audio_encoder_prompt,
    process_text_encoder_prompt,
)
from slotrunner.models.layers.cross_attention import CrossAttnMetadata, cross_attention_layers, cross_kv_shape

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


def max_decoder_len(hf_config: Any) -> int | None:
    """Decoder positions the model has (`max_target_positions`: Whisper), or None."""
    for key in ("max_target_positions", "max_position_embeddings"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return None


# -- the family state -----------------------------------------------------------------------

class EncoderDecoderModel(Protocol):
    """What EncoderDecoderModelState requires of the model, checked when the architecture is
    resolved (`model_protocol`). Besides these the model keeps its `hf_config` and has
    `CrossAttention` layers, whose caches the state allocates."""

    def encode(self, encoder_input: torch.Tensor) -> torch.Tensor:  # token ids [n] or features -> [encoder_len, hidden]
        ...

    def store_cross_kv(self, slot: int, encoder_hidden: torch.Tensor) -> None:  # writes the slot's cross K/V
        ...


class EncoderDecoderModelState(ModelState):
    """Text encoder-decoders (BART, T5): the encoder input is a token prompt."""

    family = "encoder-decoder"
    model_protocol = EncoderDecoderModel
    # Decoder K/V depend on the encoder input through cross-attention: prefix-cache blocks are
    # keyed by it too (`EncoderInputs.cache_key_spans`), so a request reuses only the decoder
    # prefix of an identical encoder input. The encoder itself runs again for every admission:
    # the cross-attention cache is per slot (`add_request` queues it whatever was cached).
    shares_prefix_kv = True
    # Decode steps replay CUDA graphs: the cross-attention metadata lives in persistent buffers
    # that prepare_attn rewrites in place (prepare_dummy_attn hands them to the capture).
    supports_cuda_graphs = True

    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        return process_text_encoder_prompt(prompt, ctx)

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        hf_config = model.hf_config
        decoder_limit = max_decoder_len(hf_config)
        if decoder_limit is not None and config.max_model_len > decoder_limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the decoder's {decoder_limit} positions: "
                f"pass max_model_len <= {decoder_limit}"
            )
        self.max_encoder_len = max_encoder_len(hf_config, config.max_model_len)
        self.cross_layers = cross_attention_layers(model)
        assert self.cross_layers, f"{type(model).__name__} has no CrossAttention layers: not an encoder-decoder"
        self.encoder_lens_np = np.zeros(config.max_num_seqs, dtype=np.int32)  # [slots], 0: no encoder output
        # Per batch row, rewritten every step at fixed addresses (CUDA graphs read them).
        self._row_encoder_lens = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=device)  # [max_num_reqs]
        self._row_tables = torch.zeros(config.max_num_seqs, 1, dtype=torch.int32, device=device)  # [max_num_reqs, 1]
        # Slots admitted since the last step whose encoder has not run yet.
        self._pending: dict[int, EncoderInputs] = {}
        self.cross_kv_bytes = 0

    def cache_bytes(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        shapes = (cross_kv_shape(self.config.max_num_seqs, self.max_encoder_len, l.num_kv_heads, l.head_dim) for l in self.cross_layers)
        return sum(math.prod(shape) for shape in shapes) * elem

    def initialize_cache(self, spec: CacheSpec) -> None:
        """One [2, max_num_seqs, max_encoder_len, kv_heads, head_dim] cache per decoder layer."""
        for layer in self.cross_layers:
            shape = cross_kv_shape(self.config.max_num_seqs, self.max_encoder_len, layer.num_kv_heads, layer.head_dim)
            # Uninitialised: a row reads only the encoder positions its request wrote.
            layer.cross_kv = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            self.cross_kv_bytes += layer.cross_kv.numel() * layer.cross_kv.element_size()

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        inputs = new_request.family_inputs
        assert isinstance(inputs, EncoderInputs), f"request {new_request.req_id}: no encoder inputs (intake must supply them)"
        self._pending[slot] = inputs
        self.encoder_lens_np[slot] = 0

    def remove_request(self, slot: int) -> None:
        # The slot's cache row is simply reused by the next request; its length marks it empty.
        self._pending.pop(slot, None)
        self.encoder_lens_np[slot] = 0

    def preprocess_state(self, batch: InputBatch) -> None:
        """Run the encoder of each newly admitted request in this batch, one request at a time,
        and store its cross-attention K/V in the request's slot."""
        if not self._pending:
            return
        with torch.inference_mode():
            for slot in batch.idx_mapping_np.tolist():
                inputs = self._pending.pop(slot, None)
                if inputs is None:
                    continue
                hidden = self.model.encode(inputs.as_tensor(self.device))  # [encoder_len, hidden]
                self.model.store_cross_kv(slot, hidden)
                self.encoder_lens_np[slot] = hidden.shape[0]

    def prepare_attn(self, batch: InputBatch) -> CrossAttnMetadata:
        n = batch.num_reqs
        lens_np = self.encoder_lens_np[batch.idx_mapping_np]
        self._row_encoder_lens[:n].copy_(torch.from_numpy(lens_np), non_blocking=True)
        self._row_tables[:n, 0].copy_(batch.idx_mapping)
        return CrossAttnMetadata(
            slots=batch.idx_mapping,
            slots_np=batch.idx_mapping_np,
            encoder_lens=self._row_encoder_lens[:n],
            encoder_lens_np=lens_np,
            block_tables=self._row_tables[:n],
        )

    def prepare_dummy_attn(self, num_reqs: int) -> CrossAttnMetadata:
        return CrossAttnMetadata(
            slots=self._row_tables[:num_reqs, 0],
            slots_np=np.zeros(num_reqs, dtype=np.int64),
            encoder_lens=self._row_encoder_lens[:num_reqs],
            encoder_lens_np=np.zeros(num_reqs, dtype=np.int32),
            block_tables=self._row_tables[:num_reqs],
        )

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs()

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        return ModelInputs()


# -- audio encoders -------------------------------------------------------------------------

class AudioEncoderDecoderModelState(EncoderDecoderModelState):
    """Speech encoder-decoders (Whisper): the encoder input is audio, the prompt the decoder's
    (the prompt forms: `process_audio_encoder_prompt`)."""

    family = "encoder-decoder (audio)"

    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        return process_audio_encoder_prompt(prompt, ctx)
