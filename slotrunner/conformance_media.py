"""Audio and image requests for a conformance case, built from the checkpoint's own processor
(or feature extractor), as the suite builds them for its tiny cases. Part of the harness in
`slotrunner/conformance.py`.

Two kinds of model take media:
- an audio encoder-decoder (Whisper): each request is a clip, plus a decoder prefix; the oracle
  gets the clip's `input_features` from the feature extractor (`Seq2SeqOracle`);
- a decoder with a media tower (LLaVA, Qwen2-VL, Qwen2-Audio): each request is text holding the
  processor's placeholder, and the images or clips; the oracle gets what the processor makes of
  them (`MediaDecoderOracle`). slotrunner's intake runs the same processor, so both see the same
  prompt ids (the recorded run's ids are what the oracle is given).
"""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotrunner.conformance_oracle import ConformanceError, ConformanceRequest, Seq2SeqOracle

NUM_BATCH = 8  # requests in the mixed batch


def takes_media(hf_config: Any, architecture: str) -> bool:
    """Whether requests to `architecture` carry images or audio (a vision or audio tower, or
    an encoder fed features instead of token ids)."""
    from slotrunner.conformance_oracle import transformers_class

    return any(getattr(hf_config, k, None) is not None for k in ("vision_config", "audio_config")) or (
        transformers_class(architecture).main_input_name != "input_ids"
    )


def load_processor(directory: str | Path) -> Any:
    """The processor saved with the checkpoint: a full processor (tokenizer + image processor or
    feature extractor), else the image processor or feature extractor alone (as slotrunner's
    loader falls back, e.g. when the full one needs torchvision). Raises ConformanceError if
    none loads."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, PreTrainedTokenizerBase

    errors = []
    for auto in (AutoProcessor, AutoImageProcessor, AutoFeatureExtractor):
        try:
            processor = auto.from_pretrained(str(directory))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as e:
            errors.append(f"{auto.__name__}: {e}")
            continue
        if not isinstance(processor, PreTrainedTokenizerBase):
            return processor
    raise ConformanceError(
        f"{directory}: the model takes images or audio, and its requests are built with the processor saved beside "
        f"it (preprocessor_config.json, processor_config.json), which did not load: {'; '.join(errors)}"
    )


def _clip(seed: int, num_samples: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(num_samples) * 0.1).astype(np.float32)


def _image(seed: int, height: int, width: int) -> Any:
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


def _params(rng: random.Random, i: int, max_tokens: int) -> Any:
    from slotrunner.sampling_params import SamplingParams

    temperature = 0.0 if i % 2 == 0 else 0.9
    return SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=rng.randrange(2, max_tokens + 1), ignore_eos=True)


# -- audio encoder-decoders (Whisper) ---------------------------------------------------------


def audio_seq2seq_requests(
    hf_config: Any, processor: Any, max_model_len: int, max_tokens: int
) -> tuple[list[ConformanceRequest], list[Any], list[Any], int]:
    """Clips of 0.025..1 s, with decoder prefixes (the decoder start token, then random ids) of
    up to 4 tokens alone and 12 in the batch; the last alone request has the longest prefix
    (the harness prefills it in chunks). Also returns the longest decoder prompt."""
    extractor = getattr(processor, "feature_extractor", processor)
    rate = int(extractor.sampling_rate)
    start = hf_config.decoder_start_token_id
    rng = random.Random(0)
    token = lambda: rng.randrange(0, hf_config.vocab_size)  # noqa: E731

    def request(seed: int, num_samples: int, prefix_len: int) -> ConformanceRequest:
        wav = _clip(seed, num_samples)
        prompt: dict[str, Any] = {"multi_modal_data": {"audio": (wav, rate)}}
        if prefix_len:
            prompt["prompt_token_ids"] = [start] + [token() for _ in range(prefix_len - 1)]
        features = extractor(wav, sampling_rate=rate, return_tensors="pt").input_features
        return ConformanceRequest(prompt, {"input_features": features})

    alone = [request(0, rate * 9 // 16, 1), request(1, rate // 40, 0), request(2, rate, 4)]
    batch, params = [], []
    for i in range(NUM_BATCH):
        prefix = min(rng.choice([0, 1, 4, 12]), max_model_len - max_tokens)
        batch.append(request(100 + i, rng.choice([rate // 50, rate // 4, rate * 9 // 16, rate]), prefix).prompt)
        params.append(_params(rng, i, max_tokens))
    return alone, batch, params, 12


# -- decoders with a media tower (LLaVA, Qwen2-VL, Qwen2-Audio) --------------------------------


class MediaDecoderOracle:
    """A transformers decoder with a vision or audio tower: the request's media tensors (what
    the processor made) go beside the token ids. No position_ids: Qwen2-VL computes its 3-D
    positions from the ids and the image grids."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model
        self._types = "mm_token_type_ids" in inspect.signature(hf_model.forward).parameters

    def _inputs(self, request: ConformanceRequest, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = next(self.hf_model.parameters()).dtype
        extra = {k: v.to(dtype) if v.is_floating_point() else v for k, v in request.oracle_inputs.items()}
        if self._types and extra:  # Qwen2-VL: which ids are image placeholders (required with image_grid_thw)
            image = getattr(self.hf_model.config, "image_token_id", None)
            extra["mm_token_type_ids"] = (ids == image).int()
        return extra

    def logits(self, request: ConformanceRequest, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            return self.hf_model(input_ids=ids, **self._inputs(request, ids)).logits[0].float()

    def greedy(self, request: ConformanceRequest, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_token_ids])
        with torch.no_grad():
            seq = self.hf_model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **self._inputs(request, ids),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return seq[0, len(prompt_token_ids) :].tolist()


def _placeholder(processor: Any, tokenizer: Any, hf_config: Any) -> tuple[str, str]:
    """(modality, the text that stands for one image or clip) as the processor expects it; an
    image processor alone (no tokenizer) takes the image token the config names."""
    if getattr(processor, "audio_token", None) is not None:
        bos, eos = getattr(processor, "audio_bos_token", ""), getattr(processor, "audio_eos_token", "")
        return "audio", f"{bos or ''}{processor.audio_token}{eos or ''}"
    image = getattr(processor, "image_token", None)
    if image is None and getattr(hf_config, "image_token_id", None) is not None:
        image = tokenizer.convert_ids_to_tokens(hf_config.image_token_id)
    if image is None:
        raise ConformanceError(f"{type(processor).__name__} names no image_token or audio_token to place media with")
    vocab = tokenizer.get_vocab()
    if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab:  # Qwen2-VL's frame around the pads
        return "image", f"<|vision_start|>{image}<|vision_end|>"
    return "image", image


def media_decoder_requests(
    hf_config: Any, processor: Any, max_tokens: int, tokenizer: Any = None
) -> tuple[list[ConformanceRequest], list[Any], list[Any], int]:
    """Text around the processor's placeholder -- one medium, two, none -- with images of a few
    sizes (or clips of 0.3..1 s). The text is random vocabulary words, decoded by the tokenizer.
    Also returns the longest prompt in tokens (a real image expands to hundreds).

    An image processor alone (Qwen2-VL's full processor needs torchvision) makes the oracle's
    image tensors, and `tokenizer` the text: slotrunner's intake then expands the image token
    itself, and the oracle is given the ids slotrunner ran (transformers refuses ids whose image
    tokens do not match the image features, so a wrong expansion still fails)."""
    full = getattr(processor, "tokenizer", None) is not None
    tokenizer = processor.tokenizer if full else tokenizer
    if tokenizer is None:
        raise ConformanceError(f"{type(processor).__name__} has no tokenizer, and none is saved beside it")
    modality, mark = _placeholder(processor, tokenizer, hf_config)
    special = set(tokenizer.all_special_ids)
    rng = random.Random(0)
    ids = [i for i in range(min(len(tokenizer), getattr(hf_config.get_text_config(), "vocab_size", len(tokenizer))))
           if i not in special]  # fmt: skip

    def words(n: int) -> str:
        return " ".join(tokenizer.decode([rng.choice(ids)]).strip() or "a" for _ in range(n))

    def medium(seed: int) -> Any:
        if modality == "audio":
            rate = int(processor.feature_extractor.sampling_rate)
            return _clip(seed, rng.choice([rate * 3 // 10, rate * 9 // 16, rate]))
        return _image(seed, rng.choice([32, 48, 64]), rng.choice([32, 40, 56]))

    lengths = []

    def request(text: str, media: list[Any]) -> ConformanceRequest:
        kwargs: dict[str, Any] = {}
        prompt: dict[str, Any] = {"prompt": text}
        if media:
            prompt["multi_modal_data"] = {modality: media}
            kwargs = {"audio": media, "sampling_rate": processor.feature_extractor.sampling_rate} if modality == "audio" else {"images": media}
        if full:
            out = processor(text=[text], return_tensors="pt", **kwargs)
            lengths.append(int(out["input_ids"].shape[-1]))
        else:
            out = processor(images=media, return_tensors="pt") if media else {}
            grid = out.get("image_grid_thw")  # each image token becomes t*h*w / merge^2 of them
            merge = getattr(processor, "merge_size", 1) ** 2
            extra = int(grid.prod(-1).sum()) // merge - len(media) if grid is not None else 0
            lengths.append(len(tokenizer(text)["input_ids"]) + extra)
        drop = ("input_ids", "attention_mask", "mm_token_type_ids")
        return ConformanceRequest(prompt, {k: v for k, v in out.items() if k not in drop and isinstance(v, torch.Tensor)} if media else {})

    alone = [
        request(f"{words(2)} {mark} {words(2)}", [medium(0)]),
        request(words(5), []),
        request(f"{mark} {words(1)} {mark} {words(3)}", [medium(1), medium(2)]),
    ]
    batch, params = [], []
    for i in range(NUM_BATCH):
        count = rng.choice([0, 1, 1, 2])
        text = " ".join([words(rng.randrange(1, 4))] + [mark] * count + [words(rng.randrange(0, 3))]).strip()
        batch.append(request(text, [medium(100 + 10 * i + j) for j in range(count)]).prompt)
        params.append(_params(rng, i, max_tokens))
    return alone, batch, params, max(lengths)


def media_requests(
    directory: str | Path, hf_config: Any, hf_model: torch.nn.Module, max_model_len: int, max_tokens: int
) -> tuple[Any, list[ConformanceRequest], list[Any], list[Any], int]:
    """(oracle, alone requests, batch prompts, batch params, longest prompt in tokens) for a
    model that takes media, from the processor saved in `directory`."""
    processor = load_processor(directory)
    if getattr(hf_config, "is_encoder_decoder", False):
        return Seq2SeqOracle(hf_model), *audio_seq2seq_requests(hf_config, processor, max_model_len, max_tokens)
    tokenizer = None
    if getattr(processor, "tokenizer", None) is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConformanceError(f"{directory}: {type(processor).__name__} has no tokenizer, and none loads: {e}") from None
    return MediaDecoderOracle(hf_model), *media_decoder_requests(hf_config, processor, max_tokens, tokenizer)
