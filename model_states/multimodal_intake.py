"""Multimodal intake: a prompt with `multi_modal_data` -> token ids with placeholder spans and media items.

The model class's MediaHandler (`media_handler_cls`, read from `IntakeContext.model_cls`, which
the engine resolves once) reads each item and the processor saved with the model preprocesses
it; the prompt's text is tokenized as written and each placeholder token expanded into one per
embedding row here -- what the model's full processor does to the text, without tokenizing the
hundreds of expanded placeholders (on the 2-core CPU machine, 1.45 of the 4.0 ms that LLaVA's
processor takes for a 336 px image and 50 words; tests/model_states check the ids against it). Each item
becomes a `MediaItem` with its placeholder span and a content hash. Every mistake raises
ValueError here, per request, before the request is queued: what the handler, PIL or the
processor raise is worded as one. Media given as a string is read only as a data URL or a file
under `IntakeContext.allowed_local_media_path` (models/layers/media_source.py).

`MultimodalInputs` travels with the request (`NewRequestData.family_inputs`) to
`MultimodalModelState.add_request`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotrunner.core_runner.engine.intake import (
    TEXT_FIELDS,
    FamilyInputs,
    IntakeContext,
    KeySpan,
    ProcessedPrompt,
    PromptType,
    check_fields,
    text_to_token_ids,
    validate_token_ids,
)
from slotrunner.models.layers.media import MediaHandler
from slotrunner.models.layers.media_item import MediaItem

MEDIA_FIELD = "multi_modal_data"


@dataclass(frozen=True)
class MultimodalInputs(FamilyInputs):
    """A request's media: item k fills prompt positions offsets[k] .. offsets[k] + num_tokens."""

    items: tuple[MediaItem, ...]
    offsets: tuple[int, ...]

    def cache_key_spans(self) -> tuple[KeySpan, ...]:
        """A placeholder span's KV depends on its media: the item's content hash keys it."""
        return tuple((off, off + item.num_tokens, item.content_hash) for item, off in zip(self.items, self.offsets))


def process_multimodal_prompt(prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
    """Text or token ids, plus the model's media in `multi_modal_data`; no media: a plain prompt."""
    fields = check_fields(prompt, TEXT_FIELDS | {MEDIA_FIELD})
    handler = media_handler(ctx)
    text, token_ids = fields.get("prompt"), fields.get("prompt_token_ids")
    if text is None and token_ids is None:
        raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    read = [handler.read(item, i) for i, item in enumerate(_media_list(fields.get(MEDIA_FIELD), handler))]
    if not read:  # a plain prompt: validated once, nothing to expand (a placeholder is an error)
        token_ids = validate_token_ids(text_to_token_ids(text, ctx) if token_ids is None else token_ids, ctx)
        _placeholder_offsets(token_ids, handler, ())
        return ProcessedPrompt(text, token_ids, None)
    precomputed = [isinstance(r, dict) for r in read]
    if not all(precomputed) and ctx.processor is None:
        raise ValueError(
            f"this model has no processor saved with it (preprocessor_config.json or processor_config.json): "
            f"give each {handler.modality} as pre-computed tensors {list(handler.data_keys)}"
        )
    if token_ids is None:
        _check_marks(text, handler, ctx, len(read))
        token_ids = text_to_token_ids(text, ctx)
    token_ids = _int_list(token_ids)
    datas = _preprocess(read, handler, ctx.processor)
    token_ids = _expand(token_ids, handler, [handler.num_tokens(d) for d in datas])
    finish = handler.device_finish(ctx.processor)  # read items leave it to the device; pre-computed ones are final
    items = tuple(handler.item(d, None if pre else finish) for d, pre in zip(datas, precomputed))
    offsets = _placeholder_offsets(token_ids, handler, items)
    token_ids = validate_token_ids(token_ids, ctx)
    return ProcessedPrompt(text, token_ids, MultimodalInputs(items, offsets) if items else None)


def media_handler(ctx: IntakeContext) -> MediaHandler:
    """The MediaHandler of the engine's model class (resolved once, carried by the context)."""
    model_cls = ctx.model_cls
    assert model_cls is not None, "IntakeContext.model_cls is unset: multimodal intake reads the model's media_handler_cls"
    handler_cls = getattr(model_cls, "media_handler_cls", None)
    assert handler_cls is not None, f"{model_cls.__name__} is served by the multimodal family but names no media_handler_cls"
    return handler_cls(ctx.hf_config, allowed_local_media_path=ctx.allowed_local_media_path)


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


def _int_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError("prompt_token_ids must be a list of ints")
    token_ids = list(token_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    return token_ids


def _check_marks(text: Any, handler: MediaHandler, ctx: IntakeContext, num_items: int) -> None:
    """A text prompt writes the placeholder once per item, where the item goes."""
    if not isinstance(text, str) or ctx.tokenizer is None:
        return  # text_to_token_ids says what is wrong
    mark = ctx.tokenizer.convert_ids_to_tokens(handler.placeholder_id)
    if isinstance(mark, str) and text.count(mark) != num_items:
        raise ValueError(
            f"prompt has {text.count(mark)} {mark!r} placeholder(s) for {num_items} {handler.modality}(s): "
            f"write one {mark!r} where each {handler.modality} goes"
        )


def _preprocess(read: list[Any], handler: MediaHandler, processor: Any) -> list[dict[str, torch.Tensor]]:
    """Each item's tensors: raw items through the processor's media part, pre-computed as given."""
    raw = [i for i, r in enumerate(read) if not isinstance(r, dict)]
    datas: list[Any] = list(read)
    if raw:
        media = handler.processor_inputs([read[i] for i in raw], processor)
        try:
            out = handler.preprocess(media, processor)
        except Exception as e:  # third-party code: any type
            raise ValueError(f"the model's processor rejected the {handler.modality}(s): {type(e).__name__}: {e}") from e
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
