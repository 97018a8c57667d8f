"""A chat message's content, as the chat template gets it: text, or OpenAI content parts.

Content is a string or a list of parts (OpenAI's chat format, as vLLM's `LLM.chat` takes it):

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | a path | "file://..."}}
    {"type": "image_pil", "image_pil": <PIL image>}          (vLLM's)
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..." | a path}}

Media parts become items of the prompt's `multi_modal_data`, in order; images travel as given
(the model's MediaHandler reads URLs and paths under `allowed_local_media_path`), audio is
decoded here (PCM WAV) into (waveform, sample rate). What the template sees depends on its
content format: "string" templates get the text parts joined by newlines, each media part as
the model's placeholder token in front; "openai" templates get the parts as a list, media parts
as {"type": "image"} / {"type": "audio"}, which the template expands itself.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_MODALITY = {"image_url": "image", "image_pil": "image", "image": "image", "input_audio": "audio", "audio_url": "audio"}


@dataclass(frozen=True)
class MediaSpec:
    """What media a model takes: its modality and the placeholder token text a "string"
    template needs in the prompt for each item."""

    modality: str  # "image" | "audio"
    placeholder: str  # e.g. "<image>"
    allowed_local_media_path: str | None = None


@dataclass
class Content:
    """One message's content split into text pieces (order kept) and media items."""

    parts: list[tuple[str, Any]]  # ("text", str) or (modality, item), in order

    @property
    def media(self) -> list[tuple[str, Any]]:
        return [(kind, item) for kind, item in self.parts if kind != "text"]


def read_content(content: Any, spec: MediaSpec | None, where: str) -> Content:
    """The parts of one message's content; ValueError naming `where` ("message 2") on a bad one."""
    if isinstance(content, str):
        return Content([("text", content)])
    if not isinstance(content, list) or not all(isinstance(p, Mapping) for p in content):
        raise ValueError(f"{where}: 'content' must be a string (or a list of content-part dicts), got {type(content).__name__}")
    parts: list[tuple[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type", "text" if "text" in part else None)
        what = f"{where}, content part {k}"
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{what}: a text part needs 'text' (a string)")
            parts.append(("text", text))
            continue
        modality = _MODALITY.get(kind)
        if modality is None:
            raise ValueError(
                f"{what}: unsupported content part type {kind!r}; use text, image_url, image_pil, input_audio or audio_url"
            )
        if spec is None or spec.modality != modality:
            takes = "text only" if spec is None else f"{spec.modality} and text"
            raise ValueError(f"{what}: this model takes no {modality} input ({takes}), got a {kind!r} part")
        parts.append((modality, _item(kind, part, spec, what)))
    return Content(parts)


def as_template_content(content: Content, content_format: str, spec: MediaSpec | None) -> str | list[dict[str, Any]]:
    """What the chat template gets as the message's content under its content format."""
    if content_format == "openai":
        return [{"type": "text", "text": v} if kind == "text" else {"type": kind} for kind, v in content.parts]
    texts = [v for kind, v in content.parts if kind == "text"]
    marks = "".join(f"{spec.placeholder}\n" for _ in content.media) if spec is not None else ""
    return marks + "\n".join(texts)


def _item(kind: str, part: Mapping[str, Any], spec: MediaSpec, what: str) -> Any:
    value = part.get(kind)
    if kind == "image" and value is None:
        value = part.get("url")  # transformers' form {"type": "image", "url": ...}
    if value is None:
        raise ValueError(f"{what}: a {kind!r} part needs {kind!r}")
    if kind in ("image_url", "audio_url"):
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f"{what}: {kind} needs a 'url' string")
        return url if kind == "image_url" else _audio_from_url(url, spec, what)
    if kind == "input_audio":
        if not isinstance(value, Mapping) or not isinstance(value.get("data"), str):
            raise ValueError(f"{what}: input_audio needs {{'data': <base64>, 'format': 'wav'}}")
        try:
            data = base64.b64decode(value["data"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{what}: input_audio 'data' is not base64 ({e})") from None
        return _decode_audio(data, str(value.get("format", "wav")), what)
    return value  # image_pil / image: the item itself, read by the model's MediaHandler


def _audio_from_url(url: str, spec: MediaSpec, what: str) -> tuple[np.ndarray, int]:
    from slotrunner.models.layers.media_source import read_media_source

    try:
        data = read_media_source(url, spec.allowed_local_media_path)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return _decode_audio(data, "wav", what)


def _decode_audio(data: bytes, fmt: str, what: str) -> tuple[np.ndarray, int]:
    """(mono float32 waveform in [-1, 1], sample rate) of an encoded audio file: PCM WAV with the
    standard library; other formats through soundfile when it is installed."""
    try:
        import soundfile
    except ImportError:
        soundfile = None
    if soundfile is not None:
        try:
            wave_, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except Exception as e:  # third-party decoder: any type
            raise ValueError(f"{what}: the {fmt} audio cannot be decoded ({type(e).__name__}: {e})") from None
        return wave_.mean(axis=1), int(rate)
    return _decode_wav(data, what)


def _decode_wav(data: bytes, what: str) -> tuple[np.ndarray, int]:
    import wave

    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise ValueError(
            f"{what}: the audio is not a PCM WAV file ({e}); install soundfile for other formats, or give the "
            "waveform in multi_modal_data"
        ) from None
    if width == 1:
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        samples = np.frombuffer(frames, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:
        raw = np.frombuffer(frames, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)) << 8 >> 8  # sign-extend 24 bits
        samples = ints.astype(np.float32) / float(2**23)
    else:
        raise ValueError(f"{what}: WAV samples of {width} bytes are not supported")
    if samples.size == 0 or samples.size % channels:
        raise ValueError(f"{what}: the WAV file holds no whole frames")
    return samples.reshape(-1, channels).mean(axis=1), rate
