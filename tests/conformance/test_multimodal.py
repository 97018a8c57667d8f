"""Multimodal conformance: LLaVA, Qwen2-VL and Qwen2-Audio equal transformers on tiny models.

Guards against: media embeddings merged at the wrong positions, or lost when chunked prefill
splits one item's placeholder span across steps; M-RoPE positions wrong in the prompt or after
it (decode and recompute use `i + delta` -- 1-D positions change logits by only ~1e-3, tokens
would not notice); a tower (CLIP feature layer, Qwen2-VL 2-D RoPE and patch merging, the audio
padding mask) that differs from transformers; one request's media leaking into another's rows;
the encoder cache running an item twice, or holding it after its placeholders are prefilled
(beyond the bounded retention of released embeddings);
preemption losing a request's media.

Each case saves a tiny random model with the processor it is used with; the oracle is
transformers' forward over the same tokens and media (logits at every position) and its greedy
`generate`. Qwen2-VL's full processor needs torchvision (its video processor), so that case
saves the image processor alone and slotrunner expands `<|image_pad|>` itself; the test builds
the oracle's ids the same documented way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import compare_greedy, compare_logits, perturb_constants, run_recorded_prompt
from slotrunner.registry import tiny_config
from slotrunner.registry import tiny_configs as tc

MAX_TOKENS = 6
CHUNK_BUDGET = 7  # tokens per step: splits every image / audio span of the prompts below
SPECIAL_IDS = [3, 4, 5, 6]  # placeholder and media-delimiter ids of the tiny configs
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Request:
    prompt: dict[str, Any]  # what slotrunner gets
    hf_media: dict[str, torch.Tensor]  # what transformers' forward gets beside input_ids
    hf_ids: list[int]  # the prompt ids transformers gets


@dataclass
class Case:
    name: str
    directory: Any
    hf: torch.nn.Module
    requests: list[Request]
    llm: LLM  # whole-prompt engine, max_num_seqs=2
    alone: list[Any] = field(default_factory=list)  # RecordedRun per request, filled by the first test


def image(seed: int, h: int, w: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def wave(seed: int, n: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(n) * 0.1).astype(np.float32)


def build_hf(arch: str, directory, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, arch)(tiny_config(arch)).eval()
    perturb_constants(model, seed)
    # Placeholder ids must never be generated (CONFORMANCE pitfall 9): a zero lm_head row gives
    # them logit 0, below the best of ~1000 random logits.
    with torch.no_grad():
        model.get_output_embeddings().weight[SPECIAL_IDS] = 0
    model.save_pretrained(str(directory))
    return model


def oracle_inputs(processor, text: str, media: list, keys: tuple[str, ...]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """transformers' prompt ids and media tensors, from the processor slotrunner loaded (with
    torchvision installed that is the torchvision image processor, whose resizing differs from
    the PIL one's). Without a full processor (Qwen2-VL, no torchvision): the image processor,
    and the tokenizer's ids with each `<|image_pad|>` repeated t*h*w/4 times, which is what
    Qwen2VLProcessor writes."""
    modality = "audio" if "input_features" in keys else "images"
    kwargs = ({modality: media} | ({"sampling_rate": 16000} if modality == "audio" else {})) if media else {}
    if getattr(processor, "tokenizer", None) is not None:
        out = processor(text=[text], return_tensors="pt", **kwargs)
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys if media}
    ids = tc.qwen2_vl_tokenizer()(text)["input_ids"]
    if not media:
        return ids, {}
    out = processor(images=media, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
    return [t for i in ids for t in ([3] * next(counts) if i == 3 else [i])], {k: out[k] for k in keys}


def make_case(name: str, arch: str, directory, save_processor, keys: tuple[str, ...], modality: str, texts) -> Case:
    hf = build_hf(arch, directory)
    save_processor(hf.config, str(directory))
    llm = engine_at(directory, max_num_seqs=2)
    requests = []
    for text, media in texts:
        ids, tensors = oracle_inputs(llm.engine.intake.processor, text, media, keys)
        requests.append(Request({"prompt": text, "multi_modal_data": {modality: media}}, tensors, ids))
    return Case(name, directory, hf, requests, llm)


def llava_case(directory) -> Case:
    texts = [
        ("w10 w11 <image> w12 w13", [image(0, 40, 50)]),
        ("<image> w20 <image> w21 w22 w23", [image(1, 32, 32), image(2, 64, 48)]),
        ("w30 w31 w32 w33 w34", []),
    ]
    save = lambda config, d: tc.llava_processor(config).save_pretrained(d)  # noqa: E731
    return make_case("llava", "LlavaForConditionalGeneration", directory, save, ("pixel_values",), "image", texts)


def qwen2_vl_case(directory) -> Case:
    vis = "<|vision_start|><|image_pad|><|vision_end|>"
    texts = [
        (f"w10 w11 {vis} w12 w13", [image(0, 16, 32)]),
        (f"{vis} w20 {vis} w21 w22", [image(1, 24, 16), image(2, 20, 20)]),
        ("w30 w31 w32 w33 w34", []),
    ]

    def save(config, d):  # the image processor and tokenizer: Qwen2VLProcessor needs torchvision
        tc.qwen2_vl_image_processor(config).save_pretrained(d)
        tc.qwen2_vl_tokenizer().save_pretrained(d)

    keys = ("pixel_values", "image_grid_thw")
    return make_case("qwen2_vl", "Qwen2VLForConditionalGeneration", directory, save, keys, "image", texts)


def qwen2_audio_case(directory) -> Case:
    clip = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    texts = [
        (f"w10 {clip} w11 w12", [wave(0, 9000)]),
        (f"w20 {clip} w21 {clip}", [wave(1, 16000), wave(2, 5000)]),  # a full-length clip and a short one
        ("w30 w31 w32 w33 w34", []),
    ]
    save = lambda config, d: tc.qwen2_audio_processor(config).save_pretrained(d)  # noqa: E731
    keys = ("input_features", "feature_attention_mask")
    return make_case("qwen2_audio", "Qwen2AudioForConditionalGeneration", directory, save, keys, "audio", texts)


BUILDERS = {"llava": llava_case, "qwen2_vl": qwen2_vl_case, "qwen2_audio": qwen2_audio_case}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory) -> Case:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def engine_at(directory, **kwargs) -> LLM:
    """Prefix caching off unless asked: logits are compared at every position."""
    kwargs = {"enable_prefix_caching": False, "max_model_len": 128} | kwargs
    return LLM(str(directory), device="cpu", block_size=4, **kwargs)


def engine(case: Case, **kwargs) -> LLM:
    return engine_at(case.directory, **kwargs)


def hf_forward(case: Case, req: Request, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] over prompt + output ids, with the request's media.
    No position_ids: Qwen2-VL computes its 3-D positions from the ids and the image grids."""
    input_ids = torch.tensor([ids])
    extra = dict(req.hf_media)
    if case.name == "qwen2_vl" and extra:
        extra["mm_token_type_ids"] = (input_ids == 3).int()
    with torch.no_grad():
        return case.hf(input_ids=input_ids, **extra).logits[0].float()


def hf_greedy(case: Case, req: Request, prompt_ids: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    extra = dict(req.hf_media)
    if case.name == "qwen2_vl" and extra:
        extra["mm_token_type_ids"] = (input_ids == 3).int()
    with torch.no_grad():
        seq = case.hf.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **extra, max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return seq[0, len(prompt_ids) :].tolist()


def test_logits_and_greedy_tokens_match_transformers(case):
    """Each request alone, whole-prompt and chunked (the budget splits every media span):
    prefill and decode logits within tolerance of transformers, greedy tokens equal."""
    whole = case.llm
    chunked = engine(case, max_num_seqs=2, max_num_batched_tokens=CHUNK_BUDGET)
    failures = []
    for i, req in enumerate(case.requests):
        run = run_recorded_prompt(whole, req.prompt, MAX_TOKENS)
        case.alone.append(run)
        assert run.prompt_token_ids == req.hf_ids, f"request {i}: prompt ids differ from transformers' processor's"
        n = len(run.prompt_token_ids)
        ref = hf_forward(case, req, run.prompt_token_ids + run.output_token_ids[:-1])
        hf_tokens = hf_greedy(case, req, run.prompt_token_ids)
        checks = [
            compare_logits(f"request {i}: prefill logits", run.logits[:n], ref[:n]),
            compare_logits(f"request {i}: decode logits", run.logits[n:], ref[n:]),
            compare_greedy(f"request {i}: greedy", run.output_token_ids, hf_tokens, ref, n),
        ]
        split = run_recorded_prompt(chunked, req.prompt, MAX_TOKENS)
        split_ref = ref
        if split.output_token_ids != run.output_token_ids:  # a near-tie went the other way: its own oracle
            split_ref = hf_forward(case, req, split.prompt_token_ids + split.output_token_ids[:-1])
        checks.append(compare_logits(f"request {i}: chunked logits", split.logits, split_ref))
        failures += [c for c in checks if not c.passed]
        print(case.name, *(f"{c.name} {c.worst:.1e}" for c in checks), sep="\n  ")
    assert not failures, f"{case.name}: " + "; ".join(f"{c.name}: {c.detail} (worst {c.worst:.2e})" for c in failures)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=4, max_num_batched_tokens=11),  # chunks split spans; rows join and leave
        dict(max_num_seqs=4, max_num_batched_tokens=11, max_model_len=64, num_kv_blocks=16),  # preemption
    ],
    ids=["chunked-mixed", "preempting"],
)
def test_mixed_batch_equals_alone(case, engine_args):
    """Requests with their own media, a text-only one and a repeat of the first in one batch:
    each yields its alone tokens (a preempted request encodes its media again unless it is still
    retained), and the encoder cache ends holding nothing, retaining at most one step's rows."""
    if not case.alone:
        pytest.skip("needs the alone runs of test_logits_and_greedy_tokens_match_transformers")
    llm = engine(case, **engine_args)
    order = [0, 2, 1, 0]
    outs = llm.generate([case.requests[i].prompt for i in order], GREEDY, use_tqdm=False)
    for row, (i, out) in enumerate(zip(order, outs)):
        got = out.outputs[0].token_ids
        assert got == case.alone[i].output_token_ids, f"{case.name}: batch row {row} (request {i}) differs from alone"
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the preempting case must preempt"
    cache = llm.engine.runner.model_state.cache
    assert cache.num_held == 0, "embeddings held in the cache after their placeholders"
    assert cache.retained_rows <= engine_args["max_num_batched_tokens"], "retention past its bound"


def test_identical_media_is_encoded_once(case):
    """Two requests with the same media admitted together share one tower run (content hash)."""
    if not case.alone:
        pytest.skip("needs the alone runs of test_logits_and_greedy_tokens_match_transformers")
    llm = engine(case, max_num_seqs=4)
    prompts = [case.requests[i].prompt for i in (1, 1, 2)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [case.alone[i].output_token_ids for i in (1, 1, 2)]
    (items,) = case.requests[1].prompt["multi_modal_data"].values()
    assert llm.engine.runner.model_state.num_encoded == len(items)


def test_precomputed_media_and_token_ids_equal_processed(case):
    """The documented fallback -- token ids with one placeholder per item, media as pre-computed
    processor tensors -- gives the same prompt and tokens as text plus raw media."""
    if not case.alone:
        pytest.skip("needs the alone runs of test_logits_and_greedy_tokens_match_transformers")
    llm = case.llm
    req, run = case.requests[0], case.alone[0]
    (modality,) = req.prompt["multi_modal_data"]
    media = req.hf_media
    precomputed = {
        "llava": lambda: media["pixel_values"][0],  # a bare [3, H, W] tensor
        "qwen2_vl": lambda: {"pixel_values": media["pixel_values"], "image_grid_thw": media["image_grid_thw"]},
        "qwen2_audio": lambda: {k: v[0:1] for k, v in media.items()},
    }[case.name]()
    ids, collapsed = [], False
    for t in run.prompt_token_ids:  # one placeholder per item: slotrunner expands it
        if t == 3 and collapsed:
            continue
        collapsed = t == 3
        ids.append(t)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {modality: precomputed}}, GREEDY, use_tqdm=False)
    out = out[0]
    assert out.prompt_token_ids == run.prompt_token_ids
    assert out.outputs[0].token_ids == run.output_token_ids


def test_decode_inputs_live_in_the_captured_buffers(case):
    """What CUDA graphs rely on (MultimodalModelState.supports_cuda_graphs): in every decode-only
    step the state merges no embeddings and its family inputs are views of the buffers that
    `prepare_dummy_inputs` hands the capture, holding this step's values."""
    if not case.alone:
        pytest.skip("needs the alone runs of test_logits_and_greedy_tokens_match_transformers")
    llm = engine(case, max_num_seqs=4)
    state = llm.engine.runner.model_state
    seen: list[tuple[bool, object]] = []
    prepare_embeds, prepare = state.prepare_inputs_embeds, state.prepare_inputs

    def record_embeds(batch):
        out = prepare_embeds(batch)
        if batch.max_query_len == 1:
            seen.append((out is None, None))
        return out

    def record_inputs(batch):
        out = prepare(batch)
        if batch.max_query_len == 1:
            dummy = state.prepare_dummy_inputs(batch.num_reqs, batch.num_tokens).as_kwargs()
            got = out.as_kwargs()
            assert got.keys() == dummy.keys()
            for k in got:
                assert got[k].data_ptr() == dummy[k].data_ptr() and got[k].shape == dummy[k].shape, k
            seen.append((True, {k: v.clone() for k, v in got.items()}))
        return out

    state.prepare_inputs_embeds, state.prepare_inputs = record_embeds, record_inputs
    outs = llm.generate([case.requests[i].prompt for i in (0, 2, 1)], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [case.alone[i].output_token_ids for i in (0, 2, 1)]
    assert seen and all(no_embeds for no_embeds, _ in seen), "a decode-only step merged media embeddings"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_equal_eager(case):
    """bf16 on the GPU: decode steps replayed from CUDA graphs give the greedy tokens of eager steps."""
    prompts = [r.prompt for r in case.requests]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(case.directory), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=4,
                  enforce_eager=eager, enable_prefix_caching=False)  # fmt: skip
        assert (llm.engine.runner.cuda_graphs is None) == eager
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert runs[True] == runs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_step_does_not_sync(case, run_decode_steps_without_sync):
    """Decode-only steps of a multimodal model (media already merged in the prefills, M-RoPE
    positions advanced on the device) never synchronize with the host."""
    llm = LLM(str(case.directory), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=4)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, r in enumerate(case.requests):
        engine.add_request(f"r{i}", r.prompt, sp)
    for _ in range(3):  # every prompt prefilled (with its media) before the checked steps
        engine.step()
    assert run_decode_steps_without_sync(engine, 5) == 5
