"""EncoderDecoderModelState: encoder outputs cached by encoder input, cross-attention K/V in rows.

The decoder is an ordinary request to the runner: its prompt is the decoder prompt, its
self-attention uses the paged KV cache. What the family adds:

- intake (`process_prompt`, in encoder_decoder_intake.py): split a prompt into the decoder
  prompt (the request's tokens) and the encoder input (`EncoderInputs`: token ids, or audio
  features for the audio subclass, with a content hash `key`);
- a cross-attention cache of max_num_seqs rows per decoder layer, allocated once in
  `initialize_cache`. A row holds the cross-attention K/V of one encoder input and is keyed by
  its hash. `add_request` maps the slot to the row that already holds its encoder input (another
  running request's, or a finished or preempted one's not yet reused: no encoder run), or else
  takes the least recently used free row and queues the encoder; `preprocess_state` runs the
  queued encoders and writes their rows. Rows are refcounted by the slots that read them; a row
  no slot reads stays cached until it is taken for another input. There is always a free row:
  at most max_num_seqs - 1 other slots are live when one is admitted.
- `prepare_attn` tells the cross-attention layers each batch row's cache row and encoder length.

So requests over one document or one recording (n > 1, several questions, a re-admission
after preemption) run the encoder once. See docs/encoder_decoder.md for the design and its
memory cost.

The model module of an encoder-decoder provides, besides forward / compute_logits /
load_weights: `hf_config`, `encode(encoder_input) -> [encoder_len, hidden]` for one request,
`store_cross_kv(row, encoder_hidden)`, and one `CrossAttention` layer per decoder layer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
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

    def store_cross_kv(self, row: int, encoder_hidden: torch.Tensor) -> None:  # writes a cache row's cross K/V
        ...


class EncoderDecoderModelState(ModelState):
    """Text encoder-decoders (BART, T5): the encoder input is a token prompt."""

    family = "encoder-decoder"
    model_protocol = EncoderDecoderModel
    # Decoder K/V depend on the encoder input through cross-attention: prefix-cache blocks are
    # keyed by it too (`EncoderInputs.cache_key_spans`), so a request reuses only the decoder
    # prefix of an identical encoder input; its cross-attention row is reused the same way.
    shares_prefix_kv = True
    # Decode steps replay CUDA graphs: the cross-attention metadata lives in persistent buffers
    # that prepare_attn rewrites in place (prepare_dummy_attn hands them to the capture). The
    # cross-attention launch reads a row's query tokens from the device too, so steps whose rows
    # carry drafts and one request's prefill chunk replay graphs as well (the encoder runs
    # before, in preprocess_state).
    supports_cuda_graphs = True
    cuda_graphs_with_drafts = True
    cuda_graphs_for_prefill = True

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
        n = config.max_num_seqs
        self._row_of_slot = np.full(n, -1, dtype=np.int64)  # [slots] cache row each slot reads, -1: none
        self._row_lens = np.zeros(n, dtype=np.int32)  # [rows] encoder length a row holds, 0: not written
        self._row_refs = np.zeros(n, dtype=np.int32)  # [rows] slots reading the row
        self._row_key: list[str | None] = [None] * n  # [rows] encoder-input hash the row holds (or is queued for)
        self._key_row: dict[str, int] = {}  # hash -> row, for every keyed row
        self._free_rows: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))  # refs 0, least recently used first
        self._pending: dict[int, EncoderInputs] = {}  # row -> encoder input queued for it
        self.num_encoder_runs = 0  # encoder runs so far (the rest of the admissions found their row cached)
        # Per batch row, rewritten every step at fixed addresses (CUDA graphs read them).
        self._row_encoder_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [max_num_reqs]
        self._row_tables = torch.zeros(n, 1, dtype=torch.int32, device=device)  # [max_num_reqs, 1]
        self.cross_kv_bytes = 0

    @property
    def encoder_lens_np(self) -> np.ndarray:
        """[slots] encoder length each slot's request reads (0: no request, or not encoded yet)."""
        rows = self._row_of_slot
        return np.where(rows >= 0, self._row_lens[np.maximum(rows, 0)], 0).astype(np.int32)

    def cache_bytes(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        shapes = (cross_kv_shape(self.config.max_num_seqs, self.max_encoder_len, l.num_kv_heads, l.head_dim) for l in self.cross_layers)
        return sum(math.prod(shape) for shape in shapes) * elem

    def initialize_cache(self, spec: CacheSpec) -> None:
        """One [2, max_num_seqs rows, max_encoder_len, kv_heads, head_dim] cache per decoder layer."""
        for layer in self.cross_layers:
            shape = cross_kv_shape(self.config.max_num_seqs, self.max_encoder_len, layer.num_kv_heads, layer.head_dim)
            # Uninitialised: a row reads only the encoder positions its input wrote.
            layer.cross_kv = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            self.cross_kv_bytes += layer.cross_kv.numel() * layer.cross_kv.element_size()

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        inputs = new_request.family_inputs
        assert isinstance(inputs, EncoderInputs), f"request {new_request.req_id}: no encoder inputs (intake must supply them)"
        assert self._row_of_slot[slot] < 0, f"slot {slot} admitted twice without remove_request"
        row = self._key_row.get(inputs.key)
        if row is None:
            row = next(iter(self._free_rows))  # least recently used; one is always free (see the module doc)
            old = self._row_key[row]
            if old is not None:
                del self._key_row[old]  # its encoder output is overwritten: evicted
            self._row_key[row], self._key_row[inputs.key] = inputs.key, row
            self._row_lens[row] = 0
            self._pending[row] = inputs
        self._free_rows.pop(row, None)
        self._row_refs[row] += 1
        self._row_of_slot[slot] = row

    def remove_request(self, slot: int) -> None:
        row = int(self._row_of_slot[slot])
        if row < 0:
            return
        self._row_of_slot[slot] = -1
        self._row_refs[row] -= 1
        if self._row_refs[row]:
            return
        if row in self._pending:  # never encoded (aborted or failed before its step): nothing to keep
            del self._pending[row]
            del self._key_row[self._row_key[row]]
            self._row_key[row] = None
            self._free_rows[row] = None
            self._free_rows.move_to_end(row, last=False)  # an empty row is the first to take
        else:
            self._free_rows[row] = None  # cached, most recently used

    def preprocess_state(self, batch: InputBatch) -> None:
        """Run the encoder of each encoder input queued since the last step, one input at a
        time, and store its cross-attention K/V in its row."""
        if not self._pending:
            return
        with torch.inference_mode():
            for row in list(self._pending):
                hidden = self.model.encode(self._pending[row].as_tensor(self.device))  # [encoder_len, hidden]
                self.model.store_cross_kv(row, hidden)
                self._row_lens[row] = hidden.shape[0]
                del self._pending[row]
                self.num_encoder_runs += 1

    def prepare_attn(self, batch: InputBatch) -> CrossAttnMetadata:
        n = batch.num_reqs
        rows_np = self._row_of_slot[batch.idx_mapping_np]
        lens_np = self._row_lens[rows_np]
        self._row_encoder_lens[:n].copy_(torch.from_numpy(lens_np), non_blocking=True)
        self._row_tables[:n, 0].copy_(torch.from_numpy(rows_np), non_blocking=True)
        return CrossAttnMetadata(
            encoder_lens=self._row_encoder_lens[:n],
            encoder_lens_np=lens_np,
            block_tables=self._row_tables[:n],
        )

    def prepare_dummy_attn(self, num_reqs: int) -> CrossAttnMetadata:
        return CrossAttnMetadata(
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
    intake_workers = 8  # feature extraction (log-mel spectrograms) in numpy

    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        return process_audio_encoder_prompt(prompt, ctx)
