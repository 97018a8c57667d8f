"""Media items at intake: reading a user's images and audio, and the per-architecture
MediaHandler that turns them into the tensors the model's tower takes (a `MediaItem`,
models/layers/media_item.py: the one piece a step sees).

A multimodal model class names its handler (`media_handler_cls`); the multimodal family's
intake (model_states/multimodal_intake.py) uses it, and every mistake must become a clear
ValueError. What a user may give as one item of `multi_modal_data`:

- "image": a PIL image, encoded bytes, an HxWxC uint8 array, a `data:` URL, or a path (or
  `file://` URL) under the engine's `allowed_local_media_path` (models/layers/media_source.py:
  no path is read without it, nothing is fetched over the network) -- its size checked on the
  header before it is decoded (`decode_image`: decompression bombs and 0x0 images are refused),
  then preprocessed by the processor saved with the model; or pre-computed processor outputs
  for one image, as a dict (e.g. {"pixel_values": ..., "image_grid_thw": ...}) -- LLaVA also
  takes a bare pixel tensor [3, H, W] -- used as given, for models whose processor cannot be
  built or loaded.
- "audio": a 1-D waveform (numpy or torch), or (waveform, sampling_rate), at most the feature
  extractor's chunk (`n_samples`; 30 s for Qwen2-Audio): transformers' processor would silently
  keep only its first chunk, so longer audio is refused; or a dict of pre-computed features
  ({"input_features": ..., "feature_attention_mask": ...}).
"""

from __future__ import annotations

import abc
import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from slotrunner.models.layers.media_item import MediaItem, PixelFinish
from slotrunner.models.layers.media_source import read_media_source

# Images with more pixels are refused before they are decoded (PIL's own default warning
# threshold, ~0.25 GiB as RGB); checked on the header, without touching PIL's global limit.
MAX_IMAGE_PIXELS = 89_478_485
# Longer side / shorter side above this is refused (Qwen2-VL's processor's own bound): a 1 x 10^6
# image is small, but resizing its short side to a tower's input size would make it huge.
MAX_IMAGE_ASPECT_RATIO = 200


def content_hash(modality: str, data: Mapping[str, torch.Tensor], finish: Mapping[str, PixelFinish] | None = None) -> str:
    """128 bits of SHA-256 over the item's tensors, their bytes read in place, and what the
    device still does to them (`finish`). Every media prompt pays it at intake (a 336 px image's
    pixels are 0.34 MB as uint8, 1.35 MB as float32): OpenSSL's SHA-256 uses the CPU's SHA
    instructions where it has them -- 1.2 GB/s against blake2b's 0.66 on the 2-core CI machine,
    1.4 against 2.4 ms a float32 image with the copy `tobytes` made."""
    h = hashlib.sha256(modality.encode())
    if finish:
        h.update(repr(sorted(finish.items())).encode())
    for key in sorted(data):
        t = data[key].detach().cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]


class MediaHandler(abc.ABC):
    """How one architecture reads its media at intake. Built from the HF config and the engine's
    `allowed_local_media_path` (the real path of the one directory local files may come from;
    None: no local file is read)."""

    modality: ClassVar[str]  # the key of multi_modal_data: "image" | "audio"
    data_keys: ClassVar[tuple[str, ...]]  # the tensors of one item, as the processor names them

    def __init__(self, hf_config: Any, allowed_local_media_path: str | None = None) -> None:
        self.hf_config = hf_config
        self.allowed_local_media_path = allowed_local_media_path
        self.placeholder_id = self.placeholder_token_id(hf_config)

    @staticmethod
    @abc.abstractmethod
    def placeholder_token_id(hf_config: Any) -> int:
        """The token id whose positions the item's embedding fills."""

    @abc.abstractmethod
    def num_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        """Placeholder tokens (= embedding rows) of one item."""

    @abc.abstractmethod
    def read(self, item: Any, index: int) -> Any:
        """A raw item the processor takes, or a dict of pre-computed tensors; ValueError if the
        item cannot be read."""

    @abc.abstractmethod
    def sub_processor(self, processor: Any) -> Any:
        """The part of the saved processor that preprocesses this modality alone."""

    @abc.abstractmethod
    def preprocess(self, raw: list[Any], processor: Any) -> Mapping[str, torch.Tensor]:
        """Processor outputs (batched over items) for raw items, without text."""

    def item(self, data: Mapping[str, torch.Tensor], finish: Mapping[str, PixelFinish] | None = None) -> MediaItem:
        """One item's checked tensors as the MediaItem the tower will encode; `finish`: what the
        device still applies to them (`device_finish`, for items the processor read)."""
        finish = dict(finish or {})
        return MediaItem(self.modality, data, self.num_tokens(data), content_hash(self.modality, data, finish), finish)

    def device_finish(self, processor: Any) -> dict[str, PixelFinish]:
        """Per data key, the processor's last steps that this handler leaves for the device (the
        processor is then called without them). Default: none."""
        return {}

    def check(self, data: Mapping[str, torch.Tensor], index: int) -> None:
        """Raise ValueError if one item's tensors cannot be what the tower takes. Override to
        check shapes; the default checks the keys."""
        missing = [k for k in self.data_keys if k not in data]
        if missing:
            raise ValueError(f"{self.modality} {index}: missing {missing} (an item needs {list(self.data_keys)})")

    def processor_inputs(self, raw: Sequence[Any], processor: Any) -> list[Any]:
        """What `read` returned for raw items, as the processor takes them."""
        return list(raw)

    def split(self, outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
        """Processor outputs batched over items -> one dict per item (batch of one). Default:
        every tensor has one row per item."""
        return [{k: outputs[k][i : i + 1] for k in self.data_keys} for i in range(num_items)]

    def precomputed(self, item: Any, index: int) -> dict[str, torch.Tensor]:
        """A user's pre-computed item (a dict of tensors) as batch-of-one tensors."""
        if not isinstance(item, Mapping):
            raise ValueError(
                f"{self.modality} {index}: give pre-computed inputs as a dict with {list(self.data_keys)}, "
                f"got {type(item).__name__}"
            )
        unknown = set(item) - set(self.data_keys)
        if unknown:
            raise ValueError(f"{self.modality} {index}: unknown key(s) {sorted(unknown)}; an item takes {list(self.data_keys)}")
        data = {}
        for key, value in item.items():
            try:
                t = torch.as_tensor(np.asarray(value)) if not isinstance(value, torch.Tensor) else value
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"{self.modality} {index}: {key!r} must be a tensor or an array of numbers") from None
            if t.dtype == torch.bool or t.is_complex():
                raise ValueError(f"{self.modality} {index}: {key!r} must hold real numbers, got {t.dtype}")
            data[key] = t.detach().cpu()
        self.check(data, index)
        return data


def decode_image(item: Any) -> Any:
    """A user's image (a PIL image, encoded bytes or a uint8 array) decoded as RGB. Its size is
    checked on the header, before anything is decoded: 0x0, more than MAX_IMAGE_PIXELS and an
    aspect ratio over MAX_IMAGE_ASPECT_RATIO are refused. Raises whatever PIL raises for a
    corrupt file (the caller words it)."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(item, (bytes, bytearray, memoryview)):
            item = Image.open(io.BytesIO(item))  # lazy: reads the header only
        elif isinstance(item, np.ndarray):
            if item.ndim not in (2, 3) or item.dtype != np.uint8:
                raise ValueError(f"an image array must be HxW or HxWxC uint8, got {item.dtype} {item.shape}")
            item = Image.fromarray(item)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # PIL's own limit, hit in open
        raise ValueError(f"too many pixels, refused as a possible decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise ValueError("not an image file PIL can decode (unknown format, or a corrupt or empty header)") from None
    if not isinstance(item, Image.Image):
        forms = "a PIL image, bytes, a uint8 array, a data: URL, a path or pre-computed tensors"
        raise ValueError(f"expected {forms}, got {type(item).__name__}")
    width, height = item.size
    if width < 1 or height < 1:
        raise ValueError(f"the image has no pixels ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"the image is {width}x{height} = {width * height} pixels, over the limit of {MAX_IMAGE_PIXELS} "
            "(refused as a possible decompression bomb): downscale it first"
        )
    if max(width, height) > MAX_IMAGE_ASPECT_RATIO * min(width, height):
        raise ValueError(f"the image is {width}x{height}, an aspect ratio over {MAX_IMAGE_ASPECT_RATIO}: crop or pad it first")
    item.load()  # decode now: a truncated or corrupt file fails here, not in the processor
    return item.convert("RGB")


class ImageHandler(MediaHandler):
    modality = "image"
    # The data key of the pixels the tower takes, their channels one after the other in each row
    # (PixelFinish), so that their rescale and normalize may run on the device; None: the
    # processor does every step.
    device_pixels: ClassVar[str | None] = None

    def device_finish(self, processor: Any) -> dict[str, PixelFinish]:
        finish = None if self.device_pixels is None or processor is None else PixelFinish.of(self.sub_processor(processor))
        return {} if finish is None else {self.device_pixels: finish}

    def read(self, item: Any, index: int) -> Any:
        if isinstance(item, Mapping):
            return self.precomputed(item, index)
        if isinstance(item, torch.Tensor):
            return self.from_tensor(item, index)
        try:
            if isinstance(item, (str, os.PathLike)):
                item = read_media_source(item, self.allowed_local_media_path)
            return decode_image(item)
        except Exception as e:  # PIL's decoders raise many types (OSError, SyntaxError, struct.error, ...)
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise ValueError(f"image {index} cannot be read: {why}") from None

    def from_tensor(self, t: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
        """A bare tensor as pre-computed input; models whose items need more than one tensor
        refuse it."""
        raise ValueError(f"image {index}: give pre-computed inputs as a dict with {list(self.data_keys)}, not a bare tensor")

    def sub_processor(self, processor: Any) -> Any:
        return getattr(processor, "image_processor", None) or processor

    def preprocess(self, raw: list[Any], processor: Any) -> Mapping[str, torch.Tensor]:
        finish = self.device_finish(processor)
        out = self.sub_processor(processor)(images=raw, return_tensors="pt", **(PixelFinish.SKIP if finish else {}))
        if finish:  # left unscaled, some processors still return float pixels (Qwen2-VL's patches): whole bytes
            out = {**out, self.device_pixels: _as_uint8(out[self.device_pixels])}
        return out


def _as_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels that hold whole values 0..255 as uint8 (a quarter of float32's bytes); others as given."""
    if pixels.dtype == torch.uint8 or not pixels.is_floating_point() or pixels.numel() == 0:
        return pixels
    small = pixels.to(torch.uint8)
    return small if torch.equal(small.to(pixels.dtype), pixels) else pixels


def check_audio_length(num_samples: int, sampling_rate: int, extractor: Any, what: str) -> None:
    """Refuse audio longer than the feature extractor's chunk (`n_samples`: 30 s for Whisper and
    Qwen2-Audio): the encoder's positions cover one chunk, and transformers' extractor would keep
    only the first one without a word. Audio up to the chunk is processed whole."""
    limit = getattr(extractor, "n_samples", None)
    if limit is not None and num_samples > limit:
        raise ValueError(
            f"{what} has {num_samples} samples ({num_samples / sampling_rate:.2f} s); this model's audio encoder takes at "
            f"most {limit} ({limit / sampling_rate:.2f} s): split it into chunks of at most that length"
        )


class AudioHandler(MediaHandler):
    modality = "audio"

    def read(self, item: Any, index: int) -> Any:
        if isinstance(item, Mapping):
            return self.precomputed(item, index)
        rate = None
        if isinstance(item, tuple) and len(item) == 2:
            item, rate = item
            if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)) or not rate > 0:
                raise ValueError(f"audio {index}: the sampling rate must be a positive number of Hz, got {rate!r}")
        if isinstance(item, (str, bytes, os.PathLike)):
            raise ValueError(
                f"audio {index} cannot be read: audio files and URLs are not decoded here; give the waveform "
                "(a 1-D array at the model's sampling rate, e.g. read with soundfile or librosa)"
            )
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().numpy()
        if not isinstance(item, np.ndarray) or item.ndim != 1 or item.size == 0 or not np.issubdtype(item.dtype, np.number):
            shape = getattr(item, "shape", None)
            raise ValueError(
                f"audio {index} cannot be read: expected a non-empty 1-D waveform (or (waveform, sampling_rate), "
                f"or pre-computed features), got {type(item).__name__}{'' if shape is None else f' of shape {shape}'}"
            )
        if not np.isfinite(item).all():
            raise ValueError(f"audio {index} cannot be read: the waveform holds NaN or infinite samples")
        return item.astype(np.float32), rate

    def sub_processor(self, processor: Any) -> Any:
        return getattr(processor, "feature_extractor", None) or processor

    def sampling_rate(self, processor: Any) -> int:
        return int(self.sub_processor(processor).sampling_rate)

    def processor_inputs(self, raw: Sequence[Any], processor: Any) -> list[Any]:
        """The waveforms, after checking any given sampling rate against the processor's and the
        length against its chunk (transformers' processor would cut longer audio silently)."""
        expected = self.sampling_rate(processor)
        waves = []
        for i, (wave, rate) in enumerate(raw):
            if rate is not None and rate != expected:
                raise ValueError(f"audio {i} is sampled at {rate} Hz; this model takes {expected} Hz (resample it first)")
            check_audio_length(wave.size, expected, self.sub_processor(processor), f"audio {i}")
            waves.append(wave)
        return waves

    def preprocess(self, raw: list[Any], processor: Any) -> Mapping[str, torch.Tensor]:
        out = self.sub_processor(processor)(
            raw,
            sampling_rate=self.sampling_rate(processor),
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
