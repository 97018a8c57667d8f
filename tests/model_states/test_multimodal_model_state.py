"""MultimodalModelState: intake of media, M-RoPE positions, the encoder cache, text-only cost.

Guards against: a bad media item (unreadable, wrong type, wrong shape, wrong sampling rate,
placeholders that do not match the media) failing deep inside a step or with an unclear message,
or disturbing the other requests; media silently accepted by a text-only model; M-RoPE positions
that drift from transformers' `get_rope_index`; cache references leaking (embeddings kept
forever) or dropped while a request still needs them; text-only batches paying for the family
(a tower run, merged embeddings, an M-RoPE position tensor).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.engine.intake import IntakeContext
from slotrunner.model_states.multimodal import EncoderCache, MultimodalModelState
from slotrunner.model_states.multimodal_intake import MultimodalInputs
from slotrunner.models.layers.mrope import MRotaryEmbedding, qwen2_vl_prompt_positions
from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding
from slotrunner.registry import resolve, tiny_config
from slotrunner.registry import tiny_configs as tc

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def image(seed: int = 0, h: int = 40, w: int = 50):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def context(tokenizer, processor, config) -> IntakeContext:
    """What the engine's intake sees for `config`, with the model class resolved as LLM does."""
    return IntakeContext(tokenizer, processor, config, 1000, 128, model_cls=resolve(config).model_cls)


def intake(arch: str, make_processor) -> IntakeContext:
    """What the engine's intake sees for a tiny model of `arch` (no weights needed)."""
    config = tiny_config(arch)
    processor = make_processor(config)
    return context(processor.tokenizer, processor, config)


@pytest.fixture(scope="module")
def llava_ctx() -> IntakeContext:
    return intake("LlavaForConditionalGeneration", tc.llava_processor)


@pytest.fixture(scope="module")
def audio_ctx() -> IntakeContext:
    return intake("Qwen2AudioForConditionalGeneration", tc.qwen2_audio_processor)


@pytest.fixture(scope="module")
def qwen2_vl_ctx() -> IntakeContext:
    config = tiny_config("Qwen2VLForConditionalGeneration")
    return context(tc.qwen2_vl_tokenizer(), tc.qwen2_vl_image_processor(config), config)


def process(ctx: IntakeContext, prompt):
    return MultimodalModelState.process_prompt(prompt, ctx)


# -- intake: what is accepted ------------------------------------------------------------------
def test_text_prompt_is_expanded_by_the_processor(llava_ctx):
    out = process(llava_ctx, {"prompt": "w10 <image> w11 <image>", "multi_modal_data": {"image": [image(0), image(1)]}})
    assert out.prompt_token_ids == [10] + [3] * 16 + [11] + [3] * 16
    assert isinstance(out.family_inputs, MultimodalInputs)
    assert out.family_inputs.offsets == (1, 18)
    assert [it.num_tokens for it in out.family_inputs.items] == [16, 16]
    assert out.family_inputs.items[0].content_hash != out.family_inputs.items[1].content_hash


@pytest.mark.parametrize("model", ["llava", "qwen2-audio"])
def test_text_prompt_ids_equal_the_full_processors(model, llava_ctx, audio_ctx):
    """Guards against: intake's own expansion (the text tokenized as written, each placeholder
    token repeated per embedding row) giving other ids than the model's processor, which
    tokenizes the expanded text: placeholders at the start, the end, side by side and between
    words, items of different sizes."""
    ctx = llava_ctx if model == "llava" else audio_ctx
    if model == "llava":
        mark, kwarg, key = "<image>", "images", "image"
        media = [image(0), image(1, h=61, w=23), image(2, h=17, w=90)]
    else:
        mark, kwarg, key = "<|AUDIO|>", "audio", "audio"
        media = [np.random.RandomState(i).randn(n).astype(np.float32) for i, n in enumerate((4000, 9000, 16000))]
    texts = [f"{mark}w10 w11 {mark}{mark} w12", f"w13 {mark} w14, w15{mark} w16 {mark}"]
    extra = {"sampling_rate": 16000} if model != "llava" else {}
    for text in texts:
        expected = ctx.processor(text=[text], return_tensors="pt", **{kwarg: media}, **extra)["input_ids"][0].tolist()
        given = media if model == "llava" else [(m, 16000) for m in media]
        assert process(ctx, {"prompt": text, "multi_modal_data": {key: given}}).prompt_token_ids == expected


def test_token_ids_accept_one_placeholder_per_item_or_all_of_them(llava_ctx):
    single = process(llava_ctx, {"prompt_token_ids": [10, 3, 11], "multi_modal_data": {"image": image(0)}})
    expanded = process(llava_ctx, {"prompt_token_ids": [10] + [3] * 16 + [11], "multi_modal_data": {"image": image(0)}})
    assert single.prompt_token_ids == expanded.prompt_token_ids == [10] + [3] * 16 + [11]
    assert single.family_inputs.items[0].content_hash == expanded.family_inputs.items[0].content_hash


def test_image_forms_agree(llava_ctx, tmp_path):
    """A PIL image, its file (under allowed_local_media_path), its bytes and its array are the
    same item (same content hash)."""
    import dataclasses
    import os

    img = image(3)
    img.save(tmp_path / "x.png")
    ctx = dataclasses.replace(llava_ctx, allowed_local_media_path=os.path.realpath(tmp_path))
    hashes = {
        process(ctx, {"prompt": "<image>", "multi_modal_data": {"image": form}}).family_inputs.items[0].content_hash
        for form in (img, str(tmp_path / "x.png"), png_bytes(img), np.asarray(img))
    }
    assert len(hashes) == 1


def test_text_only_prompt_to_multimodal_model_has_no_family_inputs(llava_ctx):
    out = process(llava_ctx, {"prompt": "w10 w11"})
    assert out.prompt_token_ids == [10, 11] and out.family_inputs is None


def test_qwen2_vl_without_full_processor_expands_itself(qwen2_vl_ctx):
    """Qwen2VLProcessor needs torchvision; the image processor + tokenizer path expands each
    `<|image_pad|>` to t*h*w/4 tokens, as Qwen2VLProcessor would."""
    text = "w10 <|vision_start|><|image_pad|><|vision_end|>"
    out = process(qwen2_vl_ctx, {"prompt": text, "multi_modal_data": {"image": image(0, 16, 32)}})
    assert out.prompt_token_ids == [10, 5] + [3] * 8 + [6]


def test_audio_waveform_with_its_rate(audio_ctx):
    clip = (np.zeros(9000, np.float32) + 0.1, 16000)
    out = process(audio_ctx, {"prompt": "w10 <|AUDIO|>", "multi_modal_data": {"audio": clip}})
    assert out.prompt_token_ids == [10] + [3] * 9


# -- intake: what is refused, and how ----------------------------------------------------------
def _truncated_png() -> bytes:
    data = png_bytes(image(0))
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt": "w10 <image> <image>", "multi_modal_data": {"image": image()}}, r"2 '<image>' placeholder\(s\) for 1 image"),
        ({"prompt": "w10 w11", "multi_modal_data": {"image": image()}}, r"0 '<image>' placeholder\(s\) for 1 image"),
        ({"prompt": "w10 <image>"}, "no image was given"),
        ({"prompt_token_ids": [10, 3, 3, 11], "multi_modal_data": {"image": image()}}, r"2 image placeholder token\(s\) \(id 3\) for 1 image"),
        ({"prompt_token_ids": [10] + [3] * 8 + [11] + [3] * 8, "multi_modal_data": {"image": image()}}, "not contiguous"),
        ({"prompt": "<image>", "multi_modal_data": {"image": b"not an image"}}, "image 0 cannot be read"),
        ({"prompt": "<image>", "multi_modal_data": {"image": _truncated_png()}}, "image 0 cannot be read"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "/no/such/file.png"}}, "image 0 cannot be read"),
        ({"prompt": "<image>", "multi_modal_data": {"image": 42}}, "image 0 cannot be read: expected a PIL image"),
        ({"prompt": "<image>", "multi_modal_data": {"image": torch.zeros(3, 16, 16)}}, r"pixel_values of shape \(1, 3, 16, 16\)"),
        ({"prompt": "<image>", "multi_modal_data": {"image": {"pixels": torch.zeros(1, 3, 32, 32)}}}, "unknown key"),
        ({"prompt": "<image>", "multi_modal_data": {"audio": np.zeros(100)}}, "takes no audio input"),
        ({"prompt": "<image>", "multi_modal_data": [image()]}, "must be a dict"),
        ({"prompt": "<image>", "media": [image()]}, "unsupported field"),
    ],
    ids=[
        "two-marks-one-image", "no-mark", "mark-without-image", "ids-count-mismatch", "ids-not-contiguous", "bytes-garbage",
        "truncated-png", "missing-file", "wrong-type", "tensor-wrong-size", "dict-wrong-key", "wrong-modality", "not-a-dict",
        "unknown-field",
    ],
)
def test_bad_image_input_is_a_clear_intake_error(llava_ctx, prompt, match):
    with pytest.raises(ValueError, match=match):
        process(llava_ctx, prompt)


@pytest.mark.parametrize(
    "audio, match",
    [
        ((np.zeros(9000, np.float32), 8000), "sampled at 8000 Hz; this model takes 16000 Hz"),
        (np.zeros((2, 9000), np.float32), "expected a non-empty 1-D waveform"),
        (np.array([], np.float32), "expected a non-empty 1-D waveform"),
        (np.array([0.0, np.nan] * 100, np.float32), "NaN or infinite"),
        ({"input_features": torch.zeros(1, 16, 10), "feature_attention_mask": torch.ones(1, 10)}, r"takes \[1, 16, 64\]"),
    ],
    ids=["wrong-rate", "two-dims", "empty", "nan", "features-wrong-shape"],
)
def test_bad_audio_input_is_a_clear_intake_error(audio_ctx, audio, match):
    with pytest.raises(ValueError, match=match):
        process(audio_ctx, {"prompt": "w10 <|AUDIO|>", "multi_modal_data": {"audio": audio}})


def test_qwen2_vl_precomputed_inputs_are_checked(qwen2_vl_ctx):
    bad = {"pixel_values": torch.zeros(10, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=r"grid \(1, 4, 4\) needs \[16, 96\]"):
        process(qwen2_vl_ctx, {"prompt_token_ids": [10, 3], "multi_modal_data": {"image": bad}})
    with pytest.raises(ValueError, match="not a bare tensor"):
        process(qwen2_vl_ctx, {"prompt_token_ids": [10, 3], "multi_modal_data": {"image": torch.zeros(16, 96)}})


def test_media_to_text_only_model_says_it_takes_no_media(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4)
    with pytest.raises(ValueError, match=r"prompt 0: prompt has unsupported field\(s\) \['multi_modal_data'\].*takes no media"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image()}}, GREEDY, use_tqdm=False)


# -- engine: bad requests leave the others alone; text-only rows pay nothing ---------------------
def test_bad_request_leaves_the_others_unaffected(llava_dir):
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=7)
    good = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": image(0)}}
    text = {"prompt": "w20 w21 w22"}
    before = [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)]
    bad = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": b"\x89PNG broken"}}
    with pytest.raises(ValueError, match="prompt 1: image 0 cannot be read"):
        llm.generate([good, bad, text], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "the good prompts of the failed call were withdrawn"
    # Queued directly on the engine, a bad request is refused and the queued good one runs on.
    llm.engine.add_request("good", good, GREEDY)
    with pytest.raises(ValueError, match="cannot be read"):
        llm.engine.add_request("bad", bad, GREEDY)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"] and outs[0].outputs[0].token_ids == before[0]
    assert [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)] == before
    assert llm.engine.runner.model_state.cache.num_held == 0


def test_intake_does_not_resolve_the_model_per_request(llava_dir, monkeypatch):
    """The engine resolves the model class once (IntakeContext.model_cls); intake used to call
    registry.resolve for every multimodal request to find the media handler."""
    import slotrunner.registry

    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4)

    def refuse(*args, **kwargs):
        raise AssertionError("registry.resolve called at request intake")

    monkeypatch.setattr(slotrunner.registry, "resolve", refuse)
    prompt = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": image(0)}}
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_text_only_batches_pay_nothing(llava_dir):
    """No tower run and no merged embeddings for text-only rows; media rows merge only in the
    steps whose chunk covers their placeholders."""
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=7)
    state = llm.engine.runner.model_state
    merged: list[bool] = []
    original = state.prepare_inputs_embeds

    def spy(batch):
        out = original(batch)
        merged.append(out is not None)
        return out

    state.prepare_inputs_embeds = spy
    llm.generate([{"prompt": "w20 w21 w22"}, {"prompt_token_ids": list(range(10, 30))}], GREEDY, use_tqdm=False)
    assert not any(merged) and state.num_encoded == 0
    merged.clear()
    llm.generate({"prompt": "w10 w11 <image> w12", "multi_modal_data": {"image": image(0)}}, GREEDY, use_tqdm=False)
    # 19 prompt tokens in chunks of 7: [0, 7) [7, 14) [14, 19) cover the span [2, 18); decode steps do not.
    assert merged == [True, True, True, False, False, False] and state.num_encoded == 1


# -- M-RoPE --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout",
    [
        [("text", 3), ("image", (1, 4, 8)), ("text", 2), ("image", (1, 6, 4)), ("text", 4)],
        [("image", (1, 4, 4)), ("text", 1)],  # image first
        [("text", 2), ("image", (1, 8, 4))],  # image last: delta from the image's largest position
        [("text", 5)],
    ],
    ids=["two-images", "image-first", "image-last", "text-only"],
)
def test_mrope_positions_equal_transformers_get_rope_index(layout):
    import transformers

    config = tiny_config("Qwen2VLForConditionalGeneration")
    hf = transformers.Qwen2VLModel(config)
    ids, spans, grids = [], [], []
    for kind, what in layout:
        if kind == "text":
            ids += [10] * what
        else:
            spans.append((len(ids), *what))
            grids.append(what)
            ids += [3] * (what[0] * what[1] * what[2] // 4)
    input_ids = torch.tensor([ids])
    if grids:
        ref, ref_delta = hf.get_rope_index(input_ids, (input_ids == 3).int(), image_grid_thw=torch.tensor(grids))
        ref, ref_delta = ref[:, 0], int(ref_delta)
    else:
        ref, ref_delta = torch.arange(len(ids)).expand(3, -1), 0
    positions, delta = qwen2_vl_prompt_positions(len(ids), spans, 2)
    assert torch.equal(positions, ref) and delta == ref_delta


def test_mrope_with_equal_axes_is_plain_rope():
    """A text-only batch may skip the [3, n] tensor: 1-D positions give the same rotation."""
    rope = RopeConfig(theta=10000.0)
    plain, mrope = RotaryEmbedding(16, 64, rope), MRotaryEmbedding(16, 64, rope, (2, 3, 3))
    q, k, pos = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.tensor([0, 3, 7, 8, 40])
    expected = plain(pos, q.clone(), k.clone())  # rotary may rotate its inputs in place (rotary_qk)
    for positions in (pos, pos.expand(3, -1)):
        got = mrope(positions, q.clone(), k.clone())
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, 64, rope, (2, 2, 2))


# -- encoder cache -------------------------------------------------------------------------------
def test_encoder_cache_keeps_an_embedding_while_a_request_holds_it():
    cache = EncoderCache()
    cache.acquire("a")
    cache.acquire("a")
    cache.put("a", torch.ones(2, 4))
    cache.release("a")
    assert cache.get("a") is not None, "dropped while a second request still needs it"
    cache.release("a")
    assert cache.get("a") is None and len(cache) == 0
    with pytest.raises(AssertionError, match="no request holds"):
        cache.put("b", torch.ones(1, 4))


def test_encoder_cache_retains_released_embeddings_within_its_rows():
    """Guards against: media identical to a request's that was just prefilled running the tower
    again when its own request is admitted a step later (overlapped intake, preemption), and
    retention growing without bound or evicting an embedding a request still holds."""
    cache = EncoderCache(max_retained_rows=5)
    for key, rows in (("a", 2), ("b", 2), ("c", 3)):
        cache.acquire(key)
        cache.put(key, torch.ones(rows, 4))
    cache.release("a")
    cache.release("b")
    assert cache.get("a") is not None and cache.get("b") is not None and cache.retained_rows == 4
    cache.acquire("a")  # held again: no longer counted, never evicted
    assert cache.retained_rows == 2 and cache.num_held == 2
    cache.release("c")  # b (2) + c (3) fit in 5
    assert cache.retained_rows == 5 and cache.get("b") is not None
    cache.acquire("d")
    cache.put("d", torch.ones(1, 4))
    cache.release("d")  # 6 rows: b, the least recently released, goes
    assert cache.get("b") is None and cache.get("c") is not None and cache.retained_rows == 4
    cache.acquire("e")
    cache.put("e", torch.ones(6, 4))
    cache.release("e")  # larger than the bound: dropped at once, the others stay
    assert cache.get("e") is None and cache.retained_rows == 4
    assert cache.get("a") is not None and cache.num_held == 1 and len(cache) == 3


def test_tower_inputs_are_stacked_in_item_order():
    """`stack_to_device` (what a tower takes in a step): the items' tensors along the batch dim,
    in the items' order, dtype kept."""
    from slotrunner.models.layers.media_item import MediaItem, stack_to_device

    items = [MediaItem("image", {"pixel_values": torch.full((1, 3, 2, 2), float(i))}, 4, str(i)) for i in range(3)]
    out = stack_to_device(items, "pixel_values", torch.device("cpu"))
    assert out.shape == (3, 3, 2, 2) and out.dtype == torch.float32
    assert out[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_read_images_leave_rescale_and_normalize_to_the_device(llava_ctx):
    """Guards against: pixels finished on the device that differ from the processor's own (the
    tower would see other inputs than transformers'), pre-computed pixels finished twice, or
    items of both kinds stacked out of order. LLaVA's items read by the processor hold uint8
    pixels and what the device still does; stacked, they equal the processor's float32 output
    bit for bit, in item order beside pre-computed items."""
    from slotrunner.models.layers.media_item import stack_to_device

    images = [image(0), image(1, h=61, w=23), image(2, h=17, w=90)]
    processor = llava_ctx.processor.image_processor
    expected = processor(images=images, return_tensors="pt")["pixel_values"]
    assert expected.dtype == torch.float32
    mixed = [images[0], {"pixel_values": expected[1:2]}, images[2]]  # the middle one pre-computed
    out = process(llava_ctx, {"prompt": "<image> <image> w10 <image>", "multi_modal_data": {"image": mixed}})
    items = out.family_inputs.items
    assert [it.data["pixel_values"].dtype for it in items] == [torch.uint8, torch.float32, torch.uint8]
    assert [bool(it.finish) for it in items] == [True, False, True]
    stacked = stack_to_device(items, "pixel_values", torch.device("cpu"))
    assert stacked.dtype == torch.float32 and torch.equal(stacked, expected)
    # The same image read twice is one item; read, it is not the pre-computed one (finished differently).
    again = process(llava_ctx, {"prompt": "<image>", "multi_modal_data": {"image": images[0]}}).family_inputs.items[0]
    assert again.content_hash == items[0].content_hash
    computed = process(llava_ctx, {"prompt": "<image>", "multi_modal_data": {"image": {"pixel_values": expected[:1]}}})
    assert computed.family_inputs.items[0].content_hash != items[0].content_hash


def test_qwen2_vl_patches_are_finished_on_the_device(qwen2_vl_ctx):
    """Guards against: Qwen2-VL's flattened patches [patches, C * T * P * P] normalized with the
    wrong channel's constants. Its processor returns float pixels when told not to rescale: intake
    keeps them as uint8 (whole values), and finished they equal the processor's own output."""
    from slotrunner.models.layers.media_item import stack_to_device

    images = [image(0, 16, 32), image(1, 40, 24)]
    expected = qwen2_vl_ctx.processor(images=images, return_tensors="pt")["pixel_values"]
    mark = "<|vision_start|><|image_pad|><|vision_end|>"
    out = process(qwen2_vl_ctx, {"prompt": f"w10 {mark} w11 {mark}", "multi_modal_data": {"image": images}})
    items = out.family_inputs.items
    assert all(it.data["pixel_values"].dtype == torch.uint8 and it.finish for it in items)
    assert torch.equal(stack_to_device(items, "pixel_values", torch.device("cpu")), expected)


def test_pixel_finish_follows_the_processor_settings():
    """A processor that does neither step leaves nothing to the device; one that only rescales
    or only normalizes (a scalar mean) is finished as it would have done."""
    from transformers import CLIPImageProcessorPil

    from slotrunner.models.layers.media_item import PixelFinish

    kwargs = dict(size={"shortest_edge": 14}, crop_size={"height": 14, "width": 14})
    img = image(4, h=20, w=30)
    assert PixelFinish.of(CLIPImageProcessorPil(do_rescale=False, do_normalize=False, **kwargs)) is None
    for settings in (dict(do_normalize=False), dict(do_rescale=False, image_mean=0.5, image_std=0.25)):
        processor = CLIPImageProcessorPil(**settings, **kwargs)
        finish = PixelFinish.of(processor)
        raw = processor(images=[img], return_tensors="pt", **PixelFinish.SKIP)["pixel_values"]
        assert torch.equal(finish(raw), processor(images=[img], return_tensors="pt")["pixel_values"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("finished", [False, True], ids=["float32", "uint8-finished-on-device"])
def test_gpu_tower_inputs_do_not_wait_for_queued_kernels(finished):
    """Guards against: a tower's inputs copied to the GPU from pageable memory, which has the host
    wait for every kernel queued before the copy -- under async scheduling, the step in flight --
    non_blocking or not; or finished on the device with constants copied from the host each time."""
    import time

    from slotrunner.models.layers.media_item import MediaItem, PixelFinish, stack_to_device

    finish = {"pixel_values": PixelFinish(1 / 255, (0.5, 0.4, 0.3), (0.2, 0.3, 0.4))} if finished else {}
    pixels = [torch.randint(0, 256, (1, 3, 336, 336), dtype=torch.uint8) if finished else torch.randn(1, 3, 336, 336) for _ in range(4)]
    items = [MediaItem("image", {"pixel_values": p}, 576, str(i), finish) for i, p in enumerate(pixels)]
    cuda = torch.device("cuda")
    stack_to_device(items, "pixel_values", cuda)  # the host allocator's first block
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work
    start = time.perf_counter()
    out = stack_to_device(items, "pixel_values", cuda)
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    assert waited < 0.2, f"the copy waited {waited:.2f} s for the kernels queued before it"
    expected = torch.cat(pixels)
    assert torch.equal(out.cpu(), finish["pixel_values"](expected) if finished else expected)
