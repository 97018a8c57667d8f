"""MultimodalModelState: media encoded once, merged into the input embeddings at placeholders.

Intake (`process_prompt`): the model's MediaHandler reads `multi_modal_data`, the processor
saved with the model preprocesses it (and, for a text prompt, expands each placeholder into
one token per embedding row); each item gets its placeholder span and a content hash.

In the step: a request holds a reference on each item's embedding in the EncoderCache until
every placeholder of that item has been prefilled. `prepare_inputs_embeds` runs the tower for
items that are needed by this step and not cached (identical media share one run), then writes
the rows this step's chunk covers -- a chunk may split a span -- over the text embeddings.
A batch whose chunks touch no placeholder returns None: the model embeds the ids itself.

M-RoPE models (`model.uses_mrope`): `add_request` computes the prompt's [3, prompt_len]
positions and its delta; `prepare_inputs` hands the model `mrope_positions` [3, num_tokens] --
stored positions inside the prompt, `position + delta` on all axes after it.

The family's model contract is documented in models/layers/multimodal_lm.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.engine.intake import (
    TEXT_FIELDS,
    FamilyInputs,
    IntakeContext,
    ProcessedPrompt,
    PromptType,
    check_fields,
    text_to_token_ids,
    validate_token_ids,
)
from slotrunner.model_states.interface import ModelInputs, ModelState
from slotrunner.models.layers.media import MediaHandler, MediaItem, content_hash

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.engine.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch

MEDIA_FIELD = "multi_modal_data"


@dataclass(frozen=True)
class MultimodalInputs(FamilyInputs):
    """A request's media: item k fills prompt positions offsets[k] .. offsets[k] + num_tokens."""

    items: tuple[MediaItem, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class MRopeInputs(ModelInputs):
    mrope_positions: torch.Tensor | None  # [3, num_tokens]; None: every row is plain text (all axes equal)


class EncoderCache:
    """Media embeddings by content hash, kept while some request still has to prefill them."""

    def __init__(self) -> None:
        self._embeds: dict[str, torch.Tensor] = {}  # hash -> [num_tokens, hidden]
        self._refs: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._embeds)

    def acquire(self, key: str) -> None:
        self._refs[key] += 1

    def release(self, key: str) -> None:
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            self._embeds.pop(key, None)

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

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        n = config.max_num_seqs
        self.cache = EncoderCache()
        self.media: list[_SlotMedia | None] = [None] * n
        self.has_pending_np = np.zeros(n, dtype=bool)  # [slots] placeholders still to prefill
        self.num_encoded = 0  # tower runs' items since start (tests read it)
        self.uses_mrope = bool(model.uses_mrope)
        if self.uses_mrope:
            self.mrope_prompt: list[torch.Tensor | None] = [None] * n  # [3, prompt_len] per slot, on device
            self.mrope_prompt_len_np = np.zeros(n, dtype=np.int64)  # [slots] 0: no stored positions
            self.mrope_delta_np = np.zeros(n, dtype=np.int64)  # [slots]

    # -- intake ------------------------------------------------------------------------------
    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        fields = check_fields(prompt, TEXT_FIELDS | {MEDIA_FIELD})
        handler = media_handler(ctx.hf_config)
        text, token_ids = fields.get("prompt"), fields.get("prompt_token_ids")
        if text is None and token_ids is None:
            raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        read = [handler.read(item, i) for i, item in enumerate(_media_list(fields.get(MEDIA_FIELD), handler))]
        precomputed = [isinstance(r, dict) for r in read]
        if not all(precomputed) and ctx.processor is None:
            raise ValueError(
                f"this model has no processor saved with it (preprocessor_config.json or processor_config.json): "
                f"give each {handler.modality} as pre-computed tensors {list(handler.data_keys)}"
            )
        if read and token_ids is None and not any(precomputed) and _is_full_processor(ctx.processor):
            token_ids, datas = _process_text(text, read, handler, ctx)
        else:
            if token_ids is None:
                token_ids = text_to_token_ids(text, ctx)
            token_ids = validate_token_ids(token_ids, ctx) if not read else _int_list(token_ids)
            datas = _preprocess(read, handler, ctx.processor)
            token_ids = _expand(token_ids, handler, [handler.num_tokens(d) for d in datas])
        items = tuple(
            MediaItem(handler.modality, d, handler.num_tokens(d), content_hash(handler.modality, d)) for d in datas
        )
        offsets = _placeholder_offsets(token_ids, handler, items)
        token_ids = validate_token_ids(token_ids, ctx)
        return ProcessedPrompt(text, token_ids, MultimodalInputs(items, offsets) if items else None)

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
                embeds.index_copy_(0, torch.from_numpy(dst).to(self.device), src.to(embeds.dtype))
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
        if in_prompt.size == 0 and not delta_np.any():
            return MRopeInputs(None)  # plain text everywhere: all three axes equal the positions
        delta = torch.from_numpy(np.repeat(delta_np, batch.num_scheduled_tokens_np)).to(self.device, non_blocking=True)
        positions = (batch.positions + delta).expand(3, -1).clone()  # [3, num_tokens]
        for row in in_prompt:
            start = int(batch.num_computed_tokens_np[row])
            stop = min(start + int(batch.num_scheduled_tokens_np[row]), int(self.mrope_prompt_len_np[idx[row]]))
            q0 = int(batch.query_start_loc_np[row])
            positions[:, q0 : q0 + stop - start] = self.mrope_prompt[idx[row]][:, start:stop]
        return MRopeInputs(positions)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        if not self.uses_mrope:
            return ModelInputs()
        return MRopeInputs(torch.zeros(3, num_tokens, dtype=torch.int64, device=self.device))


# -- intake helpers ----------------------------------------------------------------------------
def media_handler(hf_config: Any) -> MediaHandler:
    """The MediaHandler of the model class the registry picks for this config."""
    from slotrunner.registry import resolve

    model_cls = resolve(hf_config).model_cls
    handler_cls = getattr(model_cls, "media_handler_cls", None)
    assert handler_cls is not None, f"{model_cls.__name__} is served by the multimodal family but names no media_handler_cls"
    return handler_cls(hf_config)


def _media_list(mm: Any, handler: MediaHandler) -> list[Any]:
    if mm is None:
        return []
    if not isinstance(mm, Mapping):
        example = f"{{'{handler.modality}': item or [items]}}"
        raise ValueError(f"'{MEDIA_FIELD}' must be a dict like {example}, got {type(mm).__name__}")
    unknown = set(mm) - {handler.modality}
    if unknown:
        named = ", ".join(sorted(map(str, unknown)))
        raise ValueError(f"this model takes no {named} input; '{MEDIA_FIELD}' takes '{handler.modality}'")
    items = mm.get(handler.modality)
    if items is None:
        return []
    is_list = isinstance(items, (list, tuple)) and not _is_waveform_with_rate(items)
    return list(items) if is_list else [items]


def _is_waveform_with_rate(x: Any) -> bool:
    """(waveform, sampling_rate) is one audio item, not a list of two."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], (int, float)) and not isinstance(x[1], bool)


def _is_full_processor(processor: Any) -> bool:
    """A transformers processor that also tokenizes (and so expands placeholders in text)."""
    from transformers.processing_utils import ProcessorMixin

    return isinstance(processor, ProcessorMixin) and getattr(processor, "tokenizer", None) is not None


def _int_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError("prompt_token_ids must be a list of ints")
    token_ids = list(token_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    return token_ids


def _process_text(
    text: Any, read: list[Any], handler: MediaHandler, ctx: IntakeContext
) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    """Tokenize, expand placeholders and preprocess in one call to the model's processor."""
    processor = ctx.processor
    if not isinstance(text, str) or not text:
        raise ValueError("'prompt' must be a non-empty string")
    mark = processor.tokenizer.convert_ids_to_tokens(handler.placeholder_id)
    if text.count(mark) != len(read):
        raise ValueError(
            f"prompt has {text.count(mark)} {mark!r} placeholder(s) for {len(read)} {handler.modality}(s): "
            f"write one {mark!r} where each {handler.modality} goes"
        )
    media = handler.processor_inputs(read, processor)
    kwargs = {handler.processor_kwarg: media, **handler.processor_kwargs(processor)}
    try:
        out = processor(text=[text], return_tensors="pt", **kwargs)
    except (ValueError, TypeError, OSError, IndexError) as e:
        raise ValueError(f"the model's processor rejected the prompt or its {handler.modality}(s): {e}") from None
    datas = handler.split(out, len(read))
    for i, d in enumerate(datas):
        handler.check(d, i)
    return out["input_ids"][0].tolist(), datas


def _preprocess(read: list[Any], handler: MediaHandler, processor: Any) -> list[dict[str, torch.Tensor]]:
    """Each item's tensors: raw items through the processor's media part, pre-computed as given."""
    raw = [i for i, r in enumerate(read) if not isinstance(r, dict)]
    datas: list[Any] = list(read)
    if raw:
        media = handler.processor_inputs([read[i] for i in raw], processor)
        try:
            out = handler.preprocess(media, processor)
        except (ValueError, TypeError, OSError, IndexError) as e:
            raise ValueError(f"the model's processor rejected the {handler.modality}(s): {e}") from None
        for i, d in zip(raw, handler.split(out, len(raw))):
            datas[i] = d
    for i, d in enumerate(datas):
        handler.check(d, i)
    return datas


def _expand(token_ids: list[int], handler: MediaHandler, counts: list[int]) -> list[int]:
    """Token ids with one placeholder per item expanded to the item's token count; ids that
    already hold every placeholder token are kept."""
    pid = handler.placeholder_id
    found = token_ids.count(pid)
    if not counts or found == sum(counts):
        return token_ids
    if found != len(counts):
        what = handler.modality
        raise ValueError(
            f"prompt has {found} {what} placeholder token(s) (id {pid}) for {len(counts)} {what}(s) of {counts} "
            f"tokens: give one placeholder per {what}, or exactly {sum(counts)} (already expanded)"
        )
    out: list[int] = []
    it = iter(counts)
    for t in token_ids:
        out.extend([pid] * next(it) if t == pid else [t])
    return out


def _placeholder_offsets(token_ids: list[int], handler: MediaHandler, items: Sequence[MediaItem]) -> tuple[int, ...]:
    """Where each item's span starts: items fill the placeholder tokens in order, each a run."""
    what, pid = handler.modality, handler.placeholder_id
    where = np.flatnonzero(np.asarray(token_ids) == pid)
    if not items and where.size:
        raise ValueError(f"prompt holds {where.size} {what} placeholder token(s) (id {pid}) but no {what} was given")
    needed = sum(it.num_tokens for it in items)
    if where.size != needed:
        raise ValueError(f"prompt holds {where.size} {what} placeholder tokens (id {pid}); its {what}(s) fill {needed}")
    offsets, k = [], 0
    for i, item in enumerate(items):
        run = where[k : k + item.num_tokens]
        if run[-1] - run[0] != item.num_tokens - 1:
            raise ValueError(f"the placeholder tokens of {what} {i} are not contiguous")
        offsets.append(int(run[0]))
        k += item.num_tokens
    return tuple(offsets)
