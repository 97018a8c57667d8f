"""Media intake is safe to expose: what a string may name, what an image may decode to, how long audio may be.

Guards against (issue #22): media given as a string opened as any local path -- a FIFO blocked
`generate()` forever, and any readable file (/etc/passwd, a symlink out of a directory) was read;
a 0x0 image and a decompression-bomb PNG escaping as ZeroDivisionError / DecompressionBombError
instead of a ValueError at intake (so `LLM.generate` could not refuse the call cleanly); an image
decoded before its size was checked; Qwen2-Audio keeping only the first processor chunk of longer
audio (5 s became 1 s) without a word, where Whisper refused it. Local paths now follow vLLM:
read only under an explicit `allowed_local_media_path`, regular files only.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import zlib

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.builder import EngineArgs
from slotrunner.core_runner.engine.intake import IntakeContext
from slotrunner.model_states.encoder_decoder_intake import process_audio_encoder_prompt
from slotrunner.model_states.multimodal import MultimodalModelState
from slotrunner.models.layers import media
from slotrunner.registry import resolve, tiny_config
from slotrunner.registry import tiny_configs as tc

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FIFO_TIMEOUT_S = 60  # far above an intake refusal (milliseconds); a blocked open() never returns
RATE = 16000  # the tiny audio processors' sampling rate; their chunk (n_samples) is one second


def image(seed: int = 0, h: int = 40, w: int = 50):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int, height: int, rows: int | None = None) -> bytes:
    """A 1-bit greyscale PNG of width x height, all black: every row compresses to almost
    nothing, so 20000 x 20000 (400 M pixels, 1.2 GB as RGB) fits in ~50 KB. `rows` writes only
    that many rows (a file that declares more than it holds)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, row = zlib.compressobj(9), b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(compressor.compress(row) for _ in range(height if rows is None else rows)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def context(arch: str, processor, allowed: str | None = None) -> IntakeContext:
    config = tiny_config(arch)
    model_cls = resolve(config).model_cls
    return IntakeContext(processor.tokenizer, processor, config, 1000, 128, model_cls=model_cls, allowed_local_media_path=allowed)


@pytest.fixture(scope="module")
def llava_processor():
    return tc.llava_processor(tiny_config("LlavaForConditionalGeneration"))


@pytest.fixture
def media_dir(tmp_path):
    """An allowed directory with a good image, a FIFO, links out of it and into it, and a sibling
    directory outside it holding a good image too."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    image(3).save(allowed / "ok.png")
    image(3).save(outside / "secret.png")
    os.mkfifo(allowed / "fifo")
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "link_to_fifo.png").symlink_to(allowed / "fifo")
    (allowed / "inner_link.png").symlink_to(allowed / "ok.png")
    return allowed, outside


def process(ctx: IntakeContext, item, prompt: str = "<image>"):
    return MultimodalModelState.process_prompt({"prompt": prompt, "multi_modal_data": {"image": item}}, ctx)


def returns_in_time(fn, fifo) -> BaseException | None:
    """Run fn in a thread; fail (after unblocking it) if it is still waiting on the FIFO after
    FIFO_TIMEOUT_S. Returns what fn raised."""
    raised: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:  # handed to the test
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(FIFO_TIMEOUT_S)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the reader's open() returns
        thread.join(FIFO_TIMEOUT_S)
        pytest.fail(f"reading media blocked on the FIFO {fifo} for {FIFO_TIMEOUT_S} s")
    return raised[0] if raised else None


# -- strings: data URLs, and local files only under allowed_local_media_path ---------------------
def test_fifo_is_refused_without_blocking(llava_processor, media_dir):
    allowed, _ = media_dir
    fifo = str(allowed / "fifo")
    cases = [
        (None, fifo, "read only under the engine's allowed_local_media_path"),
        (str(allowed), fifo, "not a regular file"),
        (str(allowed), str(allowed / "link_to_fifo.png"), "not a regular file"),
    ]
    for root, item, match in cases:
        ctx = context("LlavaForConditionalGeneration", llava_processor, root)
        error = returns_in_time(lambda: process(ctx, item), fifo)
        assert isinstance(error, ValueError), error
        assert "image 0 cannot be read" in str(error) and match in str(error), error


@pytest.mark.parametrize(
    "name, match",
    [
        ("outside", "is outside allowed_local_media_path"),
        ("escape.png", "is outside allowed_local_media_path"),
        ("dotdot", "is outside allowed_local_media_path"),
        ("missing.png", "cannot be opened: No such file"),
        ("directory", "not a regular file"),
    ],
)
def test_paths_outside_the_allowed_directory_are_refused(llava_processor, media_dir, name, match):
    allowed, outside = media_dir
    path = {
        "outside": outside / "secret.png",
        "dotdot": allowed / ".." / "outside" / "secret.png",
        "directory": allowed,
    }.get(name, allowed / name)
    ctx = context("LlavaForConditionalGeneration", llava_processor, str(allowed))
    with pytest.raises(ValueError, match=f"image 0 cannot be read: .*{match}"):
        process(ctx, str(path))


def test_no_path_is_read_without_an_allowed_directory(llava_processor, media_dir):
    allowed, _ = media_dir
    ctx = context("LlavaForConditionalGeneration", llava_processor)
    for item in (str(allowed / "ok.png"), allowed / "ok.png", f"file://{allowed / 'ok.png'}", "/etc/passwd"):
        with pytest.raises(ValueError, match="allowed_local_media_path.*which is not set"):
            process(ctx, item)


def test_a_path_inside_equals_the_image_itself(llava_processor, media_dir):
    """A path, a Path, a file:// URL, a link inside the directory, a data URL and the PIL image
    are one item (same content hash, same tokens)."""
    allowed, _ = media_dir
    ctx = context("LlavaForConditionalGeneration", llava_processor, str(allowed))
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(image(3))).decode()
    forms = [image(3), str(allowed / "ok.png"), allowed / "ok.png", f"file://{allowed / 'ok.png'}",
             str(allowed / "inner_link.png"), data_url]
    outs = [process(ctx, form) for form in forms]
    assert len({o.family_inputs.items[0].content_hash for o in outs}) == 1
    assert all(o.prompt_token_ids == outs[0].prompt_token_ids for o in outs)


@pytest.mark.parametrize(
    "item, match",
    [
        ("https://example.com/cat.png", "https URLs are not fetched"),
        ("http://127.0.0.1/cat.png", "http URLs are not fetched"),
        ("ftp://example.com/cat.png", "unsupported URL scheme 'ftp'"),
        ("file://otherhost/tmp/cat.png", "file URL .* names host 'otherhost'"),
        ("data:image/png,rawtext", "must be base64-encoded"),
        ("data:image/png;base64,@@@@", "base64 payload is invalid"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image file PIL can decode"),
        ("", "expected a data: URL or a file path"),
    ],
    ids=["https", "http", "ftp", "file-remote-host", "data-not-base64", "data-bad-base64", "data-not-an-image", "empty"],
)
def test_urls_that_are_not_read(llava_processor, tmp_path, item, match):
    ctx = context("LlavaForConditionalGeneration", llava_processor, str(tmp_path))
    with pytest.raises(ValueError, match=f"image 0 cannot be read: .*{match}"):
        process(ctx, item)


def test_allowed_local_media_path_must_be_an_existing_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad, match in ((tmp_path / "missing", "not an existing directory"), (tmp_path / "file", "not an existing directory"),
                       ("", "non-empty str"), (42, "non-empty str")):
        with pytest.raises(ValueError, match=f"allowed_local_media_path.*{match}"):
            EngineArgs(allowed_local_media_path=bad)


# -- images: the size is checked before decoding; PIL's errors become ValueError -------------------
def test_bad_images_are_refused_at_intake(llava_processor, monkeypatch):
    from PIL import Image

    ctx = context("LlavaForConditionalGeneration", llava_processor)
    cases = [
        (np.zeros((0, 0, 3), np.uint8), r"no pixels \(0x0\)"),
        (np.zeros((5, 0), np.uint8), r"no pixels \(0x5\)"),
        (Image.new("RGB", (0, 0)), r"no pixels \(0x0\)"),
        (bomb_png(20000, 20000), "decompression bomb"),  # PIL's own limit (raised in Image.open)
        (bomb_png(2, 1000), "aspect ratio over 200"),
        (png_bytes(image(0))[:60], "image 0 cannot be read"),  # corrupt: truncated
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image file PIL can decode"),
        (np.zeros((4, 4, 3), np.float32), "must be HxW or HxWxC uint8"),
    ]
    for item, match in cases:
        with pytest.raises(ValueError, match=match):
            process(ctx, item)
    # Our own limit, with PIL's turned off: checked on the header, before a byte is decompressed
    # (the file holds 1 of its 300 rows: decoding it would fail with another message).
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 300 * 300 - 1)
    with pytest.raises(ValueError, match=r"300x300 = 90000 pixels, over the limit of 89999"):
        process(ctx, bomb_png(300, 300, rows=1))
    with pytest.raises(ValueError, match="over the limit"):
        process(ctx, Image.new("L", (300, 300)))  # a PIL image given as it is: the same limit


def test_processor_errors_of_any_type_become_value_errors(llava_processor, monkeypatch):
    ctx = context("LlavaForConditionalGeneration", llava_processor)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(type(llava_processor.image_processor), "__call__", broken)
    with pytest.raises(ValueError, match="processor rejected the image.*ZeroDivisionError"):
        process(ctx, image(0))


# -- the engine refuses the whole call and serves the next one ----------------------------------
def test_engine_refuses_bad_media_and_stays_usable(llava_dir, media_dir):
    allowed, outside = media_dir
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4, allowed_local_media_path=str(allowed))
    good = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": image(3)}}
    text = {"prompt": "w20 w21 w22"}
    expected = [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)]
    from_path = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": str(allowed / "ok.png")}}
    assert [o.outputs[0].token_ids for o in llm.generate([from_path, text], GREEDY, use_tqdm=False)] == expected
    bad_items = [
        (str(allowed / "fifo"), "not a regular file"),
        (str(outside / "secret.png"), "is outside allowed_local_media_path"),
        (str(allowed / "escape.png"), "is outside allowed_local_media_path"),
        (np.zeros((0, 0, 3), np.uint8), "no pixels"),
        (bomb_png(20000, 20000), "decompression bomb"),
        (b"\x89PNG broken", "cannot be read"),
    ]
    for item, match in bad_items:
        bad = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": item}}
        error = returns_in_time(lambda: llm.generate([good, bad, text], GREEDY, use_tqdm=False), str(allowed / "fifo"))
        assert isinstance(error, ValueError) and str(error).startswith("prompt 1: image 0 cannot be read"), error
        assert match in str(error), error
        assert not llm.engine.has_unfinished_requests(), "the good prompts of the refused call were withdrawn"
        assert [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)] == expected


# -- audio: up to the processor's chunk it is processed whole; longer is refused ------------------
def wave(seed: int, n: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(n) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def audio_processor():
    return tc.qwen2_audio_processor(tiny_config("Qwen2AudioForConditionalGeneration"))


def test_transformers_cuts_long_audio_to_one_chunk(audio_processor):
    """Why longer audio is refused: transformers' Qwen2-Audio processor keeps its first chunk
    (n_samples) and says nothing; the encoder's positions cover one chunk only."""
    out = audio_processor(text=["<|AUDIO|>"], audio=[wave(0, 5 * RATE)], sampling_rate=RATE, return_tensors="pt")
    one = audio_processor(text=["<|AUDIO|>"], audio=[wave(0, 5 * RATE)[:RATE]], sampling_rate=RATE, return_tensors="pt")
    assert torch.equal(out["input_features"], one["input_features"]) and out["input_ids"].tolist() == one["input_ids"].tolist()


@pytest.mark.parametrize("num_samples", [RATE // 3, RATE])
def test_audio_up_to_the_chunk_is_processed_whole_as_transformers_does(audio_processor, num_samples):
    """Text and token-id prompts give transformers' ids and features (the conformance suite then
    checks the logits of a full-chunk clip, tests/conformance/test_multimodal.py)."""
    ctx = context("Qwen2AudioForConditionalGeneration", audio_processor)
    clip = wave(1, num_samples)
    ref = audio_processor(text=["w10 <|AUDIO|> w11"], audio=[clip], sampling_rate=RATE, return_tensors="pt")
    for prompt in ({"prompt": "w10 <|AUDIO|> w11"}, {"prompt_token_ids": [10, 3, 11]}):
        out = MultimodalModelState.process_prompt({**prompt, "multi_modal_data": {"audio": (clip, RATE)}}, ctx)
        assert out.prompt_token_ids == ref["input_ids"][0].tolist()
        (item,) = out.family_inputs.items
        assert torch.equal(item.data["input_features"], ref["input_features"])
        assert torch.equal(item.data["feature_attention_mask"], ref["feature_attention_mask"])


def test_longer_audio_is_refused_naming_the_limit_as_whisper_does(audio_processor):
    qwen = context("Qwen2AudioForConditionalGeneration", audio_processor)
    config = tiny_config("WhisperForConditionalGeneration")
    whisper = IntakeContext(None, tc.whisper_feature_extractor(config), config, config.vocab_size, 32)
    limit = rf"takes at most {RATE} \(1.00 s\): split it into chunks"
    for prompt in ({"prompt": "w10 <|AUDIO|>"}, {"prompt_token_ids": [10, 3]}):
        with pytest.raises(ValueError, match=rf"audio 0 has {5 * RATE} samples \(5.00 s\); .*{limit}"):
            MultimodalModelState.process_prompt({**prompt, "multi_modal_data": {"audio": (wave(0, 5 * RATE), RATE)}}, qwen)
    with pytest.raises(ValueError, match=rf"audio has {5 * RATE} samples \(5.00 s\); .*{limit}"):
        process_audio_encoder_prompt({"multi_modal_data": {"audio": (wave(0, 5 * RATE), RATE)}}, whisper)
    process_audio_encoder_prompt({"multi_modal_data": {"audio": (wave(0, RATE), RATE)}}, whisper)  # the limit itself


def test_audio_given_as_a_path_is_refused_unread(audio_processor, tmp_path):
    ctx = context("Qwen2AudioForConditionalGeneration", audio_processor, str(tmp_path))
    os.mkfifo(tmp_path / "fifo.wav")
    for item, match in ((str(tmp_path / "fifo.wav"), "audio files and URLs are not decoded here"),
                        ((wave(0, 100), -5), "sampling rate must be a positive number")):
        error = returns_in_time(
            lambda: MultimodalModelState.process_prompt({"prompt": "<|AUDIO|>", "multi_modal_data": {"audio": item}}, ctx),
            str(tmp_path / "fifo.wav"),
        )
        assert isinstance(error, ValueError) and match in str(error), error


def test_precomputed_tensors_that_cannot_be_what_the_tower_takes_are_refused(llava_processor, audio_processor):
    """Strings, ragged lists and bools as tensors used to escape as TypeError; an audio mask of
    1000s made 16001 placeholder tokens for an item whose tower gives 16 rows."""
    llava = context("LlavaForConditionalGeneration", llava_processor)
    qwen = context("Qwen2AudioForConditionalGeneration", audio_processor)
    features = torch.zeros(1, 16, 64)
    cases = [
        (llava, "image", {"pixel_values": "abc"}, "must be a tensor or an array of numbers"),
        (llava, "image", {"pixel_values": [[1.0], [1.0, 2.0]]}, "must be a tensor or an array of numbers"),
        (llava, "image", {"pixel_values": torch.zeros(1, 3, 32, 32, dtype=torch.bool)}, "must hold real numbers"),
        (qwen, "audio", {"input_features": features, "feature_attention_mask": torch.full((1, 64), 1000.0)}, "only 0 and 1"),
    ]
    for ctx, modality, item, match in cases:
        with pytest.raises(ValueError, match=f"{modality} 0: .*{match}"):
            MultimodalModelState.process_prompt({"prompt_token_ids": [10, 3], "multi_modal_data": {modality: item}}, ctx)
