"""Encoder-decoder intake: a prompt -> the decoder prompt (the request's tokens) and its encoder input.

The prompt forms are vLLM's (docs/encoder_decoder.md): a plain prompt is the encoder's, or
{"encoder_prompt": E, "decoder_prompt": D}. A text encoder (BART, T5) takes token ids; an audio
encoder (Whisper) takes log-mel features computed here by the feature extractor saved with the
model. The decoder prompt starts with the decoder start token. Every mistake raises ValueError
here, per request, before the request is queued.

`EncoderInputs` travels with the request (`NewRequestData.family_inputs`) to
`EncoderDecoderModelState.add_request`, which encodes it in the step that admits the request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotrunner.core_runner.engine.intake import (
    FamilyInputs,
    IntakeContext,
    KeySpan,
    ProcessedPrompt,
    PromptType,
    check_fields,
    text_to_token_ids,
    validate_token_ids,
)
from slotrunner.models.layers.media import check_audio_length


@dataclass(frozen=True)
class EncoderInputs(FamilyInputs):
    """One request's encoder input, kept with the request (a re-admission whose encoder output
    is no longer cached encodes it again)."""

    token_ids: tuple[int, ...] | None = None  # text encoders
    features: torch.Tensor | None = None  # [num_mel_bins, num_frames] float32 on the host: audio encoders
    text: str | None = None  # the encoder prompt's text, when it was given as text (for outputs only)

    def __post_init__(self) -> None:
        assert (self.token_ids is None) != (self.features is None), "exactly one of token_ids and features"
        # Every decoder token's KV depends on the encoder input (cross-attention): its hash keys
        # every prefix-cache block of the request. Computed once, here.
        if self.token_ids is not None:
            data = np.asarray(self.token_ids, dtype=np.int64).tobytes()
        else:
            data = self.features.detach().cpu().contiguous().numpy().tobytes() + str(tuple(self.features.shape)).encode()
        object.__setattr__(self, "_key", "encoder:" + hashlib.blake2b(data, digest_size=16).hexdigest())

    @property
    def key(self) -> str:
        """The encoder input's content hash: keys prefix-cache blocks and the state's cache of
        encoder outputs (two requests with equal keys have equal cross-attention K/V)."""
        return self._key

    def cache_key_spans(self) -> tuple[KeySpan, ...]:
        return ((0, 1 << 62, self._key),)

    def encoder_prompt(self) -> tuple[str | None, list[int] | None]:
        return self.text, None if self.token_ids is None else list(self.token_ids)

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        if self.token_ids is not None:
            return torch.tensor(self.token_ids, dtype=torch.int64, device=device)  # [encoder_len]
        return self.features.to(device)  # [num_mel_bins, num_frames]


# -- limits read from the HF config (intake and the cache sizes must agree) ------------------

def max_encoder_len(hf_config: Any, max_model_len: int) -> int:
    """Encoder positions one request may use. A learned position table bounds it
    (`max_source_positions`: Whisper, after its stride-2 convolution; `max_position_embeddings`:
    BART); relative positions (T5) have no table, so max_model_len bounds them."""
    for key in ("max_source_positions", "max_position_embeddings"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return max_model_len


def decoder_start_token_id(hf_config: Any) -> int:
    """The token every decoder prompt starts with (T5 uses its pad token)."""
    start = getattr(hf_config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(hf_config, "pad_token_id", None)
    if start is None:
        raise ValueError("the model's config names no decoder_start_token_id (nor a pad_token_id to use instead)")
    return int(start)


# -- text encoders (BART, T5) ---------------------------------------------------------------

_PART_FIELDS = frozenset({"prompt", "prompt_token_ids"})
_EXPLICIT_FIELDS = frozenset({"encoder_prompt", "decoder_prompt"})


def process_text_encoder_prompt(prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
    """A text encoder-decoder's prompt: token ids for the encoder, the decoder prompt's for the request."""
    if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
        raise ValueError("the prompt has 'multi_modal_data', but this model takes text only (no audio or images)")
    encoder_part, decoder_part = split_prompt(prompt)
    encoder_ids = encoder_token_ids(encoder_part, ctx)
    encoder_text = encoder_part if isinstance(encoder_part, str) else encoder_part.get("prompt")
    text, decoder_ids = decoder_token_ids(decoder_part, ctx)
    return ProcessedPrompt(text, decoder_ids, EncoderInputs(token_ids=tuple(encoder_ids), text=encoder_text))


def _part_token_ids(part: Any, ctx: IntakeContext, what: str, add_special_tokens: bool) -> tuple[str | None, list[int]]:
    """One side of an encoder-decoder prompt: text, {"prompt": text} or {"prompt_token_ids": [...]}."""
    if isinstance(part, Mapping) and "multi_modal_data" in part:
        raise ValueError(f"{what} has 'multi_modal_data', but this model takes text only (no audio or images)")
    fields = check_fields(part, _PART_FIELDS)
    text, token_ids = fields.get("prompt"), fields.get("prompt_token_ids")
    if text is None and token_ids is None:
        raise ValueError(f"{what} needs 'prompt' (text) or 'prompt_token_ids'")
    if token_ids is None:
        token_ids = text_to_token_ids(text, ctx, add_special_tokens=add_special_tokens)
    return text, token_ids


def split_prompt(prompt: PromptType) -> tuple[Any, Any]:
    """(encoder part, decoder part or None) of vLLM's encoder-decoder prompt forms:
    {"encoder_prompt": ..., "decoder_prompt": ...}, or a plain prompt that is the encoder's."""
    if isinstance(prompt, Mapping) and set(prompt) & _EXPLICIT_FIELDS:
        check_fields(prompt, _EXPLICIT_FIELDS)
        if prompt.get("encoder_prompt") is None:
            raise ValueError("missing encoder input: the prompt has 'decoder_prompt' but no 'encoder_prompt'")
        return prompt["encoder_prompt"], prompt.get("decoder_prompt")
    return prompt, None


def _is_empty(part: Any) -> bool:
    """No decoder prompt: None, "", or {"prompt": ""} / {"prompt_token_ids": []}."""
    if isinstance(part, Mapping):
        values = [part.get(k) for k in _PART_FIELDS]
        return set(part) <= _PART_FIELDS and all(v is None or (hasattr(v, "__len__") and len(v) == 0) for v in values)
    return part is None or part == ""


def decoder_token_ids(part: Any, ctx: IntakeContext) -> tuple[str | None, list[int]]:
    """The decoder prompt: absent -> [decoder start]; otherwise its tokens (text is tokenized
    without special tokens: it is a prefix to continue), with the start token put first when
    missing, as transformers' generate does."""
    start = decoder_start_token_id(ctx.hf_config)
    if _is_empty(part):
        return None, [start]
    text, token_ids = _part_token_ids(part, ctx, "decoder_prompt", add_special_tokens=False)
    if isinstance(token_ids, (list, tuple)) and list(token_ids[:1]) != [start]:
        token_ids = [start, *token_ids]
    return text, validate_token_ids(token_ids, ctx, what="decoder_prompt")


def encoder_token_ids(part: Any, ctx: IntakeContext) -> list[int]:
    _, token_ids = _part_token_ids(part, ctx, "encoder_prompt", add_special_tokens=True)
    # The decoder's max_model_len does not apply to the encoder; its own limit does.
    token_ids = validate_token_ids(token_ids, dataclasses.replace(ctx, max_model_len=sys.maxsize), what="encoder_prompt")
    limit = max_encoder_len(ctx.hf_config, ctx.max_model_len)
    if len(token_ids) > limit:
        raise ValueError(f"encoder_prompt has {len(token_ids)} tokens; this model's encoder takes at most {limit}")
    return token_ids


# -- audio encoders (Whisper) ---------------------------------------------------------------

_AUDIO_FIELDS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})


def process_audio_encoder_prompt(prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
    """A speech encoder-decoder's prompt: audio features for the encoder, the decoder prompt's
    tokens for the request.

    Prompt forms: {"prompt": decoder prefix, "multi_modal_data": {"audio": (waveform, rate)}}
    ("prompt_token_ids" for the prefix works too; no prefix: the decoder start token), or
    {"encoder_prompt": {"multi_modal_data": {"audio": ...}}, "decoder_prompt": ...}.
    """
    if isinstance(prompt, Mapping) and set(prompt) & _EXPLICIT_FIELDS:
        encoder_part, decoder_part = split_prompt(prompt)
        encoder_fields = check_fields(encoder_part, _AUDIO_FIELDS)
        if encoder_fields.get("prompt") or encoder_fields.get("prompt_token_ids"):
            raise ValueError("this model's encoder takes audio, not text: put the text in 'decoder_prompt'")
    else:
        encoder_fields = check_fields(prompt, _AUDIO_FIELDS)
        decoder_fields = {k: v for k, v in encoder_fields.items() if k != "multi_modal_data"}
        decoder_part = decoder_fields or None
    mm = encoder_fields.get("multi_modal_data")
    if mm is None:
        raise ValueError(
            "missing encoder input: this model transcribes audio; give "
            "{'multi_modal_data': {'audio': (waveform, sample_rate)}}"
        )
    if not isinstance(mm, Mapping) or set(mm) != {"audio"}:
        got = sorted(mm) if isinstance(mm, Mapping) else type(mm).__name__
        raise ValueError(f"multi_modal_data must hold exactly one 'audio' item; got {got}")
    features = audio_features(mm["audio"], ctx)
    text, decoder_ids = decoder_token_ids(decoder_part, ctx)
    return ProcessedPrompt(text, decoder_ids, EncoderInputs(features=features))


def _waveform(audio: Any) -> tuple[np.ndarray, int]:
    if not (isinstance(audio, (tuple, list)) and len(audio) == 2):
        raise ValueError("multi_modal_data['audio'] must be a (waveform, sample_rate) pair")
    waveform, sample_rate = audio
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().numpy()
    try:
        waveform = np.asarray(waveform, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError("the audio waveform must be a 1-D array of floats") from None
    if waveform.ndim != 1:
        raise ValueError(f"the audio waveform must be 1-D (mono), got shape {tuple(waveform.shape)}")
    if waveform.size == 0:
        raise ValueError("the audio waveform is empty")
    if not np.isfinite(waveform).all():
        raise ValueError("the audio waveform holds NaN or infinite samples")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"the audio sample rate must be a positive int, got {sample_rate!r}")
    return waveform, int(sample_rate)


def audio_features(audio: Any, ctx: IntakeContext) -> torch.Tensor:  # [num_mel_bins, num_frames]
    """Log-mel features by the feature extractor saved with the model, checked against the
    encoder's fixed input length (2 * max_source_positions frames)."""
    extractor = getattr(ctx.processor, "feature_extractor", ctx.processor)
    if extractor is None:
        raise ValueError("this model needs its feature extractor (preprocessor_config.json beside the weights) to read audio")
    waveform, sample_rate = _waveform(audio)
    if sample_rate != extractor.sampling_rate:
        raise ValueError(f"audio is sampled at {sample_rate} Hz; this model takes {extractor.sampling_rate} Hz: resample it first")
    check_audio_length(waveform.size, sample_rate, extractor, "audio")  # as Qwen2-Audio's intake does
    try:
        features = extractor(waveform, sampling_rate=sample_rate, return_tensors="np")["input_features"][0]
    except Exception as e:  # third-party code: any type
        raise ValueError(f"the feature extractor rejected the audio: {type(e).__name__}: {e}") from e
    expected = 2 * int(ctx.hf_config.max_source_positions)
    if features.shape[-1] != expected:
        raise ValueError(
            f"the feature extractor gives {features.shape[-1]} frames but the encoder takes exactly {expected}: "
            "preprocessor_config.json does not match this model"
        )
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
