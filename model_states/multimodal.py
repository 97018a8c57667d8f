"""MultimodalModelState: media encoded once, merged into the input embeddings at placeholders.

Intake (`process_prompt`, in multimodal_intake.py) turns `multi_modal_data` into media items,
each with its placeholder span in the prompt and a content hash (`MultimodalInputs`).

In the step: a request holds a reference on each item's embedding in the EncoderCache until
every placeholder of that item has been prefilled; released embeddings stay retained within one
step's rows (`EncoderCache`). `prepare_inputs_embeds` runs the tower for
items that are needed by this step and not cached (identical media share one run), then writes
the rows this step's chunk covers -- a chunk may split a span -- over the text embeddings.
A batch whose chunks touch no placeholder returns None: the model embeds the ids itself.

M-RoPE models (`model.uses_mrope`): `add_request` computes the prompt's [3, prompt_len]
positions and its delta; `prepare_inputs` hands the model `mrope_positions` [3, num_tokens] --
stored positions inside the prompt, `position + delta` on all axes after it -- written in place
into one persistent buffer.

CUDA graphs: a decode-only batch has no placeholder to fill (every item's span lies in a
prompt, prefilled before the request decodes), so `prepare_inputs_embeds` returns None and the
model embeds the ids itself; the only family input is `mrope_positions`, which lives at the
address `prepare_dummy_inputs` gave the capture. Decode steps therefore replay the graphs the
default decoder uses, with speculative drafts too (rows of 1 + k tokens: the M-RoPE positions
of text after the prompt are `position + delta`, written for every token of the step); prefill
and mixed steps (where media is merged) run eagerly, but a tower whose items share one input
shape (LLaVA's CLIP) replays its own graphs there (tower_graphs.py).

What the state calls on its model is `MultimodalModel` below (models/multimodal_lm.py is the
in-tree base that provides it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.engine.intake import IntakeContext, ProcessedPrompt, PromptType
from slotrunner.core_runner.runner.model_state import ModelInputs, ModelState
from slotrunner.model_states.multimodal_intake import MultimodalInputs, process_multimodal_prompt
from slotrunner.model_states.tower_graphs import TowerGraphs, encode_in_chunks
from slotrunner.models.layers.media import MediaHandler
from slotrunner.models.layers.media_item import MediaItem

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


class MultimodalModel(Protocol):
    """What MultimodalModelState and its intake require of the model, checked when the
    architecture is resolved (`model_protocol`)."""

    media_handler_cls: ClassVar[type[MediaHandler]]  # how intake reads the model's media
    uses_mrope: ClassVar[bool]  # forward takes mrope_positions [3, num_tokens]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        ...

    def encode_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:  # one [item.num_tokens, hidden] each
        ...

    def mrope_prompt_positions(
        self, prompt_len: int, items: Sequence[MediaItem], offsets: Sequence[int]
    ) -> tuple[torch.Tensor, int]:  # ([3, prompt_len] positions, delta after the prompt); only with uses_mrope
        ...


@dataclass(frozen=True)
class MRopeInputs(ModelInputs):
    mrope_positions: torch.Tensor  # [3, num_tokens], a view of the state's persistent buffer


class EncoderCache:
    """Media embeddings by content hash, kept while some request still has to prefill them.

    An embedding no request holds any more is retained, least recently released evicted first,
    while the retained ones total at most `max_retained_rows` rows (one step's input embeddings
    by default): a request with the same media admitted a few steps later -- its prompt read
    while the first one ran (`LLM.generate` queues prompts as they are read), or re-admitted
    after a preemption -- takes it instead of running the tower again. Only rows no request
    holds count towards the bound, so the held ones are never evicted.
    """

    def __init__(self, max_retained_rows: int = 0) -> None:
        self._embeds: dict[str, torch.Tensor] = {}  # hash -> [num_tokens, hidden], held or retained
        self._refs: Counter[str] = Counter()
        self._retained: OrderedDict[str, int] = OrderedDict()  # hash -> rows, least recently released first
        self._retained_rows = 0
        self.max_retained_rows = max_retained_rows

    def __len__(self) -> int:
        return len(self._embeds)

    @property
    def num_held(self) -> int:
        """Media some request still has to prefill (the rest of `len` is retained)."""
        return len(self._refs)

    @property
    def retained_rows(self) -> int:
        return self._retained_rows

    def acquire(self, key: str) -> None:
        self._refs[key] += 1
        rows = self._retained.pop(key, None)
        if rows is not None:
            self._retained_rows -= rows

    def release(self, key: str) -> None:
        self._refs[key] -= 1
        if self._refs[key] > 0:
            return
        del self._refs[key]
        embeds = self._embeds.get(key)
        if embeds is None:
            return
        if embeds.shape[0] > self.max_retained_rows:
            del self._embeds[key]
            return
        self._retained[key] = embeds.shape[0]
        self._retained_rows += embeds.shape[0]
        while self._retained_rows > self.max_retained_rows:
            old, rows = self._retained.popitem(last=False)
            self._retained_rows -= rows
            del self._embeds[old]

    def get(self, key: str) -> torch.Tensor | None:
        return self._embeds.get(key)

    def put(self, key: str, embeds: torch.Tensor) -> None:
        assert self._refs[key] > 0, f"caching media {key} that no request holds"
        self._embeds[key] = embeds


@dataclass
class _SlotMedia:
    items: tuple[MediaItem, ...]
    starts: np.ndarray  # [num_items] first placeholder position
    ends: np.ndarray  # [num_items] one past the last
    held: np.ndarray  # [num_items] bool: the request still holds the item's cache reference


class MultimodalModelState(ModelState):
    family = "multimodal"
    model_protocol = MultimodalModel
    # Decode steps replay CUDA graphs, with drafts too: see the module docstring.
    supports_cuda_graphs = True
    cuda_graphs_with_drafts = True

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        n = config.max_num_seqs
        self.cache = EncoderCache(max_retained_rows=config.max_num_batched_tokens)
        self.media: list[_SlotMedia | None] = [None] * n
        self.has_pending_np = np.zeros(n, dtype=bool)  # [slots] placeholders still to prefill
        self.num_encoded = 0  # tower runs' items since start (tests read it)
        self.uses_mrope = bool(model.uses_mrope)
        # A tower of one input shape (tower_graphs.py) runs over the items stacked, in chunks,
        # replayed from CUDA graphs where graphs are on; any other through `encode_media`.
        self._stacked = hasattr(model, "stack_media")
        self.tower_graphs: TowerGraphs | None = None
        if self._stacked and device.type == "cuda" and not config.enforce_eager:
            self.tower_graphs = TowerGraphs(model.encode_stacked)
        if self.uses_mrope:
            self.mrope_prompt: list[torch.Tensor | None] = [None] * n  # [3, prompt_len] per slot, on device
            self.mrope_prompt_len_np = np.zeros(n, dtype=np.int64)  # [slots] 0: no stored positions
            self.mrope_delta_np = np.zeros(n, dtype=np.int64)  # [slots]
            # Every step's positions, written in place (a captured graph reads this address).
            self._mrope_buf = torch.zeros(3, config.max_num_batched_tokens, dtype=torch.int64, device=device)

    # -- intake ------------------------------------------------------------------------------
    intake_workers = 8  # image/audio decoding and preprocessing: PIL and numpy release the GIL

    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        return process_multimodal_prompt(prompt, ctx)

    # -- slots -------------------------------------------------------------------------------
    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        self._clear(slot)
        inputs = new_request.family_inputs
        if inputs is None:
            return
        assert isinstance(inputs, MultimodalInputs), f"multimodal request carries {type(inputs).__name__}"
        starts = np.asarray(inputs.offsets, dtype=np.int64)
        ends = starts + np.asarray([it.num_tokens for it in inputs.items], dtype=np.int64)
        held = ends > new_request.num_computed_tokens
        for item, h in zip(inputs.items, held):
            if h:
                self.cache.acquire(item.content_hash)
        self.media[slot] = _SlotMedia(inputs.items, starts, ends, held)
        self.has_pending_np[slot] = bool(held.any())
        if self.uses_mrope:
            positions, delta = self.model.mrope_prompt_positions(new_request.prompt_len, inputs.items, inputs.offsets)
            self.mrope_prompt[slot] = positions.to(self.device, non_blocking=True)
            self.mrope_prompt_len_np[slot] = positions.shape[1]
            self.mrope_delta_np[slot] = delta

    def remove_request(self, slot: int) -> None:
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        media = self.media[slot]
        if media is not None:
            for item, h in zip(media.items, media.held):
                if h:
                    self.cache.release(item.content_hash)
        self.media[slot] = None
        self.has_pending_np[slot] = False
        if self.uses_mrope:
            self.mrope_prompt[slot] = None
            self.mrope_prompt_len_np[slot] = 0
            self.mrope_delta_np[slot] = 0

    # -- step --------------------------------------------------------------------------------
    def prepare_inputs_embeds(self, batch: InputBatch) -> torch.Tensor | None:
        rows = np.flatnonzero(self.has_pending_np[batch.idx_mapping_np])
        if rows.size == 0:
            return None  # text-only rows, or media already prefilled: nothing to merge
        # (destination token row, item, first embedding row, count) for each covered piece of a span
        plan: list[tuple[int, MediaItem, int, int]] = []
        for row in rows:
            media = self.media[batch.idx_mapping_np[row]]
            start = int(batch.num_computed_tokens_np[row])
            end = start + int(batch.num_scheduled_tokens_np[row])
            q0 = int(batch.query_start_loc_np[row])
            lo, hi = np.maximum(media.starts, start), np.minimum(media.ends, end)
            for k in np.flatnonzero(lo < hi):
                plan.append((q0 + int(lo[k]) - start, media.items[k], int(lo[k] - media.starts[k]), int(hi[k] - lo[k])))
        embeds = None
        if plan:
            with torch.inference_mode():
                self._encode_missing([item for _, item, _, _ in plan])
                embeds = self.model.embed_input_ids(batch.input_ids)
                src = torch.cat([self.cache.get(item.content_hash)[s : s + n] for _, item, s, n in plan])
                dst = np.concatenate([np.arange(d, d + n) for d, _, _, n in plan])
                # non_blocking: a blocking host->device copy waits for the stream (the tower just
                # launched, and the step before under async scheduling) before the step goes on.
                dst_gpu = torch.from_numpy(dst).to(self.device, non_blocking=True)
                embeds.index_copy_(0, dst_gpu, src.to(embeds.dtype))
        for row in rows:  # items whose last placeholder this step prefills leave the cache
            slot = batch.idx_mapping_np[row]
            media = self.media[slot]
            done = media.held & (media.ends <= int(batch.seq_lens_np[row]))
            for k in np.flatnonzero(done):
                self.cache.release(media.items[k].content_hash)
            media.held &= ~done
            self.has_pending_np[slot] = bool(media.held.any())
        return embeds

    def _encode_missing(self, items: Sequence[MediaItem]) -> None:
        todo = {it.content_hash: it for it in items if self.cache.get(it.content_hash) is None}
        if not todo:
            return
        if self._stacked:
            stacked = self.model.stack_media(list(todo.values()))
            graphs = self.tower_graphs  # read each call: benchmarks swap it to time the eager tower
            embeds = (graphs(stacked) if graphs is not None else encode_in_chunks(self.model.encode_stacked, stacked)).unbind(0)
        else:
            embeds = self.model.encode_media(list(todo.values()))
        for (key, item), emb in zip(todo.items(), embeds):
            assert emb.shape[0] == item.num_tokens, f"{item.modality} encoded to {emb.shape[0]} rows, not {item.num_tokens}"
            self.cache.put(key, emb)
        self.num_encoded += len(todo)

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        if not self.uses_mrope:
            return ModelInputs()
        idx = batch.idx_mapping_np
        delta_np = self.mrope_delta_np[idx]
        in_prompt = np.flatnonzero(batch.num_computed_tokens_np < self.mrope_prompt_len_np[idx])
        num_tokens = batch.positions.shape[0]
        positions = self._mrope_buf[:, :num_tokens]  # [3, num_tokens]
        if delta_np.any():
            delta = torch.from_numpy(np.repeat(delta_np, batch.num_scheduled_tokens_np)).to(self.device, non_blocking=True)
            positions.copy_((batch.positions + delta).expand(3, -1))
        else:  # plain text everywhere: all three axes equal the positions
            positions.copy_(batch.positions.expand(3, -1))
        for row in in_prompt:
            start = int(batch.num_computed_tokens_np[row])
            stop = min(start + int(batch.num_scheduled_tokens_np[row]), int(self.mrope_prompt_len_np[idx[row]]))
            q0 = int(batch.query_start_loc_np[row])
            positions[:, q0 : q0 + stop - start] = self.mrope_prompt[idx[row]][:, start:stop]
        return MRopeInputs(positions)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        if not self.uses_mrope:
            return ModelInputs()
        return MRopeInputs(self._mrope_buf[:, :num_tokens])
